#!/usr/bin/env python3
"""Helper of tools/gpu_bringup.sh: inventory of the wheels, environment facts, imports, summary."""
import csv, importlib.metadata as md, json, os, platform, re, runpy, shlex, subprocess, sys, types, zipfile

TARGET_MACHINE = "x86_64"
NEVER = ("torch", "torchvision", "torchaudio", "triton")


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel_name(filename):
    parts = filename[:-len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    return {"dist": norm(parts[0]), "version": parts[1], "py": parts[-3], "abi": parts[-2], "plat": parts[-1]}


def tag_problem(w, target):
    """Why this wheel cannot install for CPython ``target`` on x86-64 Linux, or None."""
    xy = target.replace(".", "")
    def py_ok(tag):
        if tag in ("py3", "py" + xy, "cp" + xy):
            return True
        if w["abi"] == "abi3" and tag.startswith("cp3"):
            return int(tag[3:] or 0) <= int(xy[1:])
        return False
    if not any(py_ok(t) for t in w["py"].split(".")):
        return f"built for {w['py']}, not CPython {target}"
    if not any(a in ("none", "abi3", "cp" + xy) for a in w["abi"].split(".")):
        return f"ABI {w['abi']}, not cp{xy}"
    plats = w["plat"].split(".")
    if not any(p == "any" or (p.endswith("_" + TARGET_MACHINE) and ("linux" in p)) for p in plats):
        return f"platform {w['plat']}, not Linux {TARGET_MACHINE}"
    return None


def read_metadata(path):
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        if not names:
            raise ValueError("no .dist-info/METADATA inside")
        text = z.read(names[0]).decode("utf-8", "replace")
    requires_python, requires = None, []
    for line in text.split("\n"):
        if not line.strip():
            break  # the headers end at the first blank line
        if line.startswith("Requires-Python:"):
            requires_python = line.split(":", 1)[1].strip()
        elif line.startswith("Requires-Dist:"):
            requires.append(line.split(":", 1)[1].strip())
    return requires_python, requires


try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:  # checks by name only
    Requirement = SpecifierSet = Version = None


def applies(req_text, target):
    """A Requires-Dist line that applies to a plain install (no extra) on CPython ``target``."""
    if Requirement is None:
        return "extra ==" not in req_text and "extra==" not in req_text
    req = Requirement(req_text)
    if req.marker is None:
        return True
    env = {"extra": "", "python_version": target, "python_full_version": target + ".0",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": TARGET_MACHINE,
           "os_name": "posix"}
    return req.marker.evaluate(env)


def req_name_spec(req_text):
    if Requirement is None:
        name = re.split(r"[ <>=!~;\[(]", req_text.strip(), 1)[0]
        return norm(name), None
    req = Requirement(req_text)
    return norm(req.name), req.specifier


def satisfies(spec, version):
    if spec is None or SpecifierSet is None or not str(spec):
        return True
    try:
        return spec.contains(version, prereleases=True)
    except Exception:
        return False


def installed_version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def repo_requirements(repo):
    """install_requires of setup.py, and pytest for the tests. setup.py computes the megatron-core and torch
    ranges (from megatron_tawpipe/compat/versions.py): it runs with a stand-in setuptools whose setup() only
    records what it is given (this Python may have no setuptools)."""
    recorded = {}
    stand_in = types.ModuleType("setuptools")
    stand_in.setup = lambda **kwargs: recorded.update(kwargs)
    stand_in.find_packages = lambda *args, **kwargs: []
    saved = sys.modules.get("setuptools")
    sys.modules["setuptools"] = stand_in
    try:
        runpy.run_path(os.path.join(repo, "setup.py"), run_name="__main__")
    finally:
        if saved is None:
            sys.modules.pop("setuptools", None)
        else:
            sys.modules["setuptools"] = saved
    return list(recorded.get("install_requires", [])) + ["pytest"]


def shell_assign(out, name, value):
    if isinstance(value, list):
        out.write(f"{name}=({' '.join(shlex.quote(v) for v in value)})\n")
    else:
        out.write(f"{name}={shlex.quote(str(value))}\n")


def inventory(wheels, repo, target, dry_run, main_pin, second_pin, download, shell_out, second_pass):
    prog = "gpu_bringup.sh"
    here = platform.python_version()
    lines, problems, notes = [], [], []
    try:
        import torch
        torch_version = torch.__version__
        cuda = bool(torch.cuda.is_available())
        gpu = torch.cuda.get_device_name(0) if cuda else ""
    except Exception as exc:  # no torch at all
        torch_version, cuda, gpu = f"not importable ({type(exc).__name__}: {exc})", False, ""
    lines.append(f"  python       {sys.executable} (CPython {here})")
    lines.append(f"  torch        {torch_version}; CUDA visible: {'yes, ' + gpu if cuda else 'no'}")
    if not re.match(r"^\d", torch_version):
        problems.append(f"torch is not importable by {sys.executable}: the machine's CUDA build of torch is used, "
                        "never a wheel (--python names the interpreter that has it)")
    if here.rsplit(".", 1)[0] != target:
        msg = (f"this Python is {here}, the wheels are checked for {target} (--target-python): "
               f"a real run needs CPython {target}")
        (notes if dry_run else problems).append(msg)
    if not cuda:
        msg = "torch sees no CUDA device: a real run needs one GPU"
        (notes if dry_run else problems).append(msg)

    # The wheels on disk.
    found = []
    if not os.path.isdir(wheels):
        lines.append(f"  wheels       {wheels} (no such folder)")
    else:
        files = sorted(f for f in os.listdir(wheels) if f.endswith(".whl"))
        lines.append(f"  wheels       {wheels} ({len(files)} wheel{'s' if len(files) != 1 else ''})")
        for f in files:
            w = parse_wheel_name(f)
            if w is None:
                problems.append(f"{f} in {wheels} is not named like a wheel (name-version-python-abi-platform.whl)")
                continue
            w["file"], w["path"] = f, os.path.join(wheels, f)
            found.append(w)

    def metadata_of(w):
        if "meta" not in w:
            try:
                w["meta"] = read_metadata(w["path"])
            except Exception as exc:
                w["meta"] = None
                msg = f"cannot read the METADATA of {w['file']} ({type(exc).__name__}: {exc})"
                if dry_run:
                    notes.append(msg + ": its Requires-Python and Requires-Dist are not checked")
                else:
                    problems.append(msg + ": download it again")
        return w["meta"]

    def usable(w, what):
        """Tag and Requires-Python of ``w`` against the target; the reason it cannot install, or None."""
        reason = tag_problem(w, target)
        meta = metadata_of(w)
        if reason is None and meta and meta[0] and SpecifierSet is not None:
            if not SpecifierSet(meta[0]).contains(target + ".0", prereleases=True):
                reason = f"Requires-Python {meta[0]} excludes {target}"
        return reason

    mcore = [w for w in found if w["dist"] == "megatron-core"]
    others = [w for w in found if w["dist"] != "megatron-core"]
    main = [w for w in mcore if w["version"].startswith("0.19.")]
    second = [w for w in mcore if w["version"] == second_pin]
    for w in mcore:
        if w not in main and w not in second:
            lines.append(f"    ignored  megatron-core {w['version']}  {w['file']}  (the passes are 0.19.x and {second_pin})")

    main_wheel, main_version = "", ""
    if len(main) > 1:
        problems.append(f"more than one megatron-core 0.19.x in {wheels} ({', '.join(w['file'] for w in main)}): keep one")
    elif not main:
        lines.append(f"    MISSING  megatron-core 0.19.x (required): {download} megatron-core=={main_pin}")
        problems.append(f"missing wheel megatron-core 0.19.x for CPython {target} in {wheels}: "
                        f"{download} megatron-core=={main_pin}")
    else:
        w = main[0]
        reason = usable(w, "megatron-core")
        if reason:
            lines.append(f"    UNUSABLE megatron-core {w['version']}  {w['file']}  ({reason})")
            problems.append(f"{w['file']} cannot install for CPython {target} ({reason}): "
                            f"{download} megatron-core=={w['version']}")
        else:
            lines.append(f"    found    megatron-core {w['version']}  {w['file']}  (pass mcore-{w['version']})")
            main_wheel, main_version = w["path"], w["version"]

    second_wheel, second_version, second_skip = "", second_pin, ""
    if len(second) > 1:
        problems.append(f"more than one megatron-core {second_pin} wheel in {wheels}: keep one")
    elif not second:
        second_skip = (f"no megatron-core {second_pin} wheel in {wheels} (optional): "
                       f"{download} megatron-core=={second_pin}")
        lines.append(f"    absent   megatron-core {second_pin} (optional second pass): {download} megatron-core=={second_pin}")
    else:
        w = second[0]
        reason = usable(w, "megatron-core")
        if reason:
            second_skip = f"{w['file']} cannot install for CPython {target}: {reason}"
            lines.append(f"    skipped  megatron-core {w['version']}  {w['file']}  ({reason}): the second pass is skipped")
        else:
            second_wheel = w["path"]
            lines.append(f"    found    megatron-core {w['version']}  {w['file']}  (pass mcore-{w['version']})")
    if second_wheel and not second_pass:
        second_skip, second_wheel = "--no-second-pass", ""
        lines[-1] += " -- not run: --no-second-pass"

    extra = []
    seen = {}
    for w in others:
        if w["dist"] in NEVER or w["dist"].startswith("nvidia-"):
            problems.append(f"{w['file']} in {wheels}: never install {w['dist']} from a wheel (the machine's CUDA "
                            "build of torch and its libraries are used): remove it")
            continue
        if w["dist"] in seen:
            problems.append(f"two versions of {w['dist']} in {wheels} ({seen[w['dist']]}, {w['file']}): keep one")
            continue
        seen[w["dist"]] = w["file"]
        reason = usable(w, w["dist"])
        if reason:
            lines.append(f"    UNUSABLE {w['dist']} {w['version']}  {w['file']}  ({reason})")
            problems.append(f"{w['file']} cannot install for CPython {target} ({reason}): "
                            f"{download} '{w['dist']}=={w['version']}'")
            continue
        lines.append(f"    found    {w['dist']} {w['version']}  {w['file']}  (installed with every pass)")
        extra.append(w)

    # What the wheels and this repository need: in the wheel folder, or installed for this Python.
    wanted = []  # (requirement, needed by, only by the optional second pass)
    for w in [x for x in main + second if x["path"] in (main_wheel, second_wheel)] + extra:
        meta = metadata_of(w)
        for text in (meta[1] if meta else []):
            if applies(text, target):
                wanted.append((text, f"{w['dist']} {w['version']}", bool(second_wheel) and w["path"] == second_wheel))
    for text in repo_requirements(repo):
        wanted.append((text, "megatron_tawpipe" if text != "pytest" else "the tests", False))
    offered = {w["dist"]: w["version"] for w in extra}
    second_reasons = []

    def fail(message, second_only):
        """A requirement the optional second pass alone has skips that pass; any other stops the run."""
        (second_reasons if second_only else problems).append(message)

    checked = set()
    lines.append("  requirements (the wheels' Requires-Dist and setup.py's install_requires; "
                 + ("checked against this machine's Python: the GPU machine's own are checked when it runs)"
                    if dry_run else "checked against this Python's packages and the wheels)"))
    for text, by, second_only in wanted:
        name, spec = req_name_spec(text)
        key = (name, str(spec))
        if key in checked:
            continue
        checked.add(key)
        if name == "megatron-core":
            for version, is_second in ((main_version, False), (second_version if second_wheel else "", True)):
                if version and not satisfies(spec, version):
                    lines.append(f"    CONFLICT {text}  ({by}): megatron-core {version}")
                    fail(f"{by} requires '{text}', the wheel is megatron-core {version}", is_second)
            if all(satisfies(spec, v) for v in (main_version, second_version if second_wheel else "") if v):
                lines.append(f"    ok       {text}  ({by})")
            continue
        if name in offered:
            ok = satisfies(spec, offered[name])
            lines.append(f"    {'ok      ' if ok else 'CONFLICT'} {text}  ({by}): wheel {offered[name]}")
            if not ok:
                fail(f"{by} requires '{text}', the wheel is {name} {offered[name]}: {download} '{text}'", second_only)
            continue
        have = installed_version(name)
        if have is not None and satisfies(spec, have):
            lines.append(f"    ok       {text}  ({by}): installed, {have}")
            continue
        if name in NEVER:
            lines.append(f"    MISSING  {text}  ({by}): installed: {have or 'none'}; the machine's own torch is used")
            fail(f"{by} requires '{text}' and {sys.executable} has torch {have or 'none'}: "
                 "use the machine's CUDA build of torch (--python), never a wheel", second_only)
            continue
        lines.append(f"    MISSING  {text}  ({by}): installed: {have or 'none'}; {download} '{text}'"
                     + ("  (the optional second pass is skipped)" if second_only else ""))
        fail(f"missing wheel {text} (required by {by}; {sys.executable} has "
             f"{name + ' ' + have if have else 'none'}): {download} '{text}'", second_only)
    if second_reasons:
        second_skip, second_wheel = "; ".join(second_reasons), ""
        notes.append(f"the second pass (megatron-core {second_version}) is skipped: {second_skip}")

    report = "\n".join(lines)
    with open(shell_out, "w") as out:
        shell_assign(out, "PY_VERSION", here)
        shell_assign(out, "TORCH_VERSION", torch_version)
        shell_assign(out, "CUDA_VISIBLE", "1" if cuda else "0")
        shell_assign(out, "GPU_NAME", gpu)
        shell_assign(out, "MAIN_WHEEL", main_wheel)
        shell_assign(out, "MAIN_VERSION", main_version)
        shell_assign(out, "SECOND_WHEEL", second_wheel)
        shell_assign(out, "SECOND_VERSION", second_version)
        shell_assign(out, "SECOND_SKIP", second_skip)
        shell_assign(out, "EXTRA_WHEELS", [w["path"] for w in extra])
        shell_assign(out, "PROBLEMS", problems)
        shell_assign(out, "NOTES", notes)
        shell_assign(out, "INVENTORY", report)
    return 0


def environment(path):
    facts = {"python": platform.python_version(), "executable": sys.executable, "machine": platform.machine(),
             "platform": platform.platform()}
    try:
        import torch
        facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                     cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     cuda_available=torch.cuda.is_available(), device_count=torch.cuda.device_count())
        try:
            facts["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as exc:
            facts["nccl"] = f"unavailable ({type(exc).__name__}: {exc})"
        devices = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                            "multiprocessors": p.multi_processor_count, "total_memory_bytes": p.total_memory,
                            "l2_cache_bytes": getattr(p, "L2_cache_size", None)})
        facts["devices"] = devices
        facts["bf16_supported"] = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        facts["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    except Exception as exc:
        facts["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=60).stdout.strip() or None
    except Exception:
        facts["driver"] = None
    names = ("megatron-core", "transformer-engine", "apex", "numpy", "packaging", "sentencepiece", "einops",
             "psutil", "pytest", "triton", "transformers", "tiktoken", "tokenizers", "tensorboard", "setuptools")
    facts["packages"] = {n: installed_version(n) for n in names}
    facts["environment"] = {k: v for k, v in os.environ.items()
                            if k.startswith(("NCCL_", "CUDA_", "PYTORCH_", "TORCH_")) or k == "PYTHONPATH"}
    with open(path, "w") as f:
        json.dump(facts, f, indent=1)
        f.write("\n")
    print(json.dumps({k: facts.get(k) for k in ("python", "torch", "torch_cuda", "nccl", "devices", "driver")}))
    return 0


def imports(site, version):
    import megatron.core as mc
    import megatron_tawpipe
    import pretrain_llama
    got = md.version("megatron-core")
    print(f"megatron-core {got} from {os.path.dirname(mc.__file__)}")
    print(f"megatron_tawpipe from {os.path.dirname(megatron_tawpipe.__file__)}")
    print(f"pretrain_llama from {pretrain_llama.__file__}")
    try:
        import transformer_engine  # noqa: F401
        print(f"transformer_engine {getattr(transformer_engine, '__version__', 'installed')}")
    except Exception as exc:
        print(f"transformer_engine not importable ({type(exc).__name__}): gpu_check's te row is skipped")
    site = os.path.realpath(site)
    wrong = [m for m in (mc.__file__, megatron_tawpipe.__file__) if not os.path.realpath(m).startswith(site + os.sep)]
    if got != version or wrong:
        print(f"error: expected megatron-core {version} and megatron_tawpipe from {site}; got {got}, {wrong}")
        return 1
    return 0


def summary(out, elapsed=None):
    rows = list(csv.reader(open(os.path.join(out, "steps.tsv")), delimiter="\t"))
    fields = ("pass", "step", "status", "exit", "seconds", "log", "command", "timeout")
    steps = [dict(zip(fields, r)) for r in rows]
    for s in steps:
        s["exit"] = int(s["exit"]) if s["exit"] not in ("", "-") else None
        s["seconds"] = float(s["seconds"]) if s["seconds"] not in ("", "-") else None
        s["timeout"] = int(s["timeout"]) if s.get("timeout") not in (None, "", "-") else None
    meta = json.load(open(os.path.join(out, "run.json")))
    failed = [s for s in steps if s["status"] != "ok" and not s["status"].startswith("skipped")]
    budget_skips = [s for s in steps if s["status"].startswith("skipped: budget")]
    meta.update(steps=steps, failed=bool(failed), skipped_for_budget=[f"{s['pass']}/{s['step']}" for s in budget_skips],
                elapsed_s=None if elapsed is None else int(elapsed))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    budget = meta.get("budget_s")
    md_lines = [f"# GPU bring-up: {meta.get('gpu') or 'no GPU'}", "",
                f"- started {meta.get('started')}, repository {meta.get('commit')}",
                f"- python {meta.get('python')}, torch {meta.get('torch')}",
                f"- passes: {', '.join(meta.get('passes') or []) or 'none'}",
                f"- budget: {f'{budget} s' if budget else 'none'}, step caps: {meta.get('step_timeout')}"
                + ("" if elapsed is None else f"; {int(elapsed)} s used when this was written")]
    for note in meta.get("skipped_passes") or []:
        md_lines.append(f"- skipped: {note}")
    if budget_skips:
        md_lines.append("- skipped for the budget: " + ", ".join(f"{s['pass']}/{s['step']}" for s in budget_skips))
    md_lines += [f"- result: {'FAILED: ' + ', '.join(s['pass'] + '/' + s['step'] for s in failed) if failed else 'no step failed'}",
                 "", "| pass | step | status | exit | seconds | timeout | log | command |",
                 "|---|---|---|---|---|---|---|---|"]
    for s in steps:
        sec = "" if s["seconds"] is None else f"{s['seconds']:.1f}"
        ex = "" if s["exit"] is None else str(s["exit"])
        limit = "" if s["timeout"] is None else ("none" if s["timeout"] == 0 else str(s["timeout"]))
        cmd = s["command"].replace("|", "\\|")
        md_lines.append(f"| {s['pass']} | {s['step']} | {s['status']} | {ex} | {sec} | {limit} | {s['log']} | `{cmd}` |")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(md_lines) + "\n")
    return 0


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "inventory":
        wheels, repo, target, dry, main_pin, second_pin, download, shell_out, second_pass = rest
        sys.exit(inventory(wheels, repo, target, dry == "1", main_pin, second_pin, download, shell_out,
                           second_pass == "1"))
    if cmd == "environment":
        sys.exit(environment(rest[0]))
    if cmd == "imports":
        sys.exit(imports(rest[0], rest[1]))
    if cmd == "summary":
        sys.exit(summary(rest[0], rest[1] if len(rest) > 1 else None))
    sys.exit(f"unknown helper command {cmd}")
