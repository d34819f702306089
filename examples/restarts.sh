# Sourced by the launch scripts: run_with_restarts CMD... runs CMD, and after a failure that a restart can
# fix runs it again, up to MAX_RESTARTS times. The scripts pass --load with their --save directory, so every
# new run resumes from the latest checkpoint: a dead rank or node costs the iterations since that checkpoint,
# not a manual step. torchrun's own --max-restarts is not used: on this torch version a restarted round
# cannot re-form its process group.
#
# torchrun reports any failed worker as exit status 1, so each rank records why it ended in a directory
# named by TAWPIPE_EXIT_DIR (a new one per attempt): a refusal before training (flags, data, tokenizer,
# checkpoint) ends the job with exit status 2, a failure that recurs from the same checkpoint (a NaN or Inf
# loss, a checkpoint that does not load) with 3; the error line is printed once, after torchrun's output.
# Anything else (a lost peer, a timeout, a killed rank) is restarted. RESTART_ANY_FAILURE=1 restarts every
# failure, as sites that want retries regardless ask for. On several nodes every node runs its own loop;
# they meet again at the next rendezvous.
#
# A stop on request is never restarted. SIGTERM to every process of the job (what Slurm sends at its time
# limit, on preemption or scancel): with --exit-signal-handler the ranks finish the iteration, save, record
# `stopped` and exit 0, torchrun (signalled too) waits for them (up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# seconds, 300 here, then kills them) and this function returns 0; without it the ranks end at once and
# it returns 143 (128 + SIGTERM). A run that stops by --exit-interval or --exit-duration-in-mins exits 0.
run_with_restarts() {
    local attempt=0 status=0 dir kind record stop_signal=""
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
    # The trap runs once the command in the foreground has ended: this shell outlives the job it runs.
    trap 'stop_signal=TERM' TERM
    while true; do
        dir=$(mktemp -d "${TMPDIR:-/tmp}/tawpipe-exit.XXXXXX")
        status=0
        TAWPIPE_EXIT_DIR="$dir" "$@" || status=$?   # (the scripts run under set -e)
        record=$(find "$dir" -maxdepth 1 -name "rank*.stopped" 2>/dev/null | sort | head -n 1)
        if [ -n "$record" ]; then
            echo "run_with_restarts: stopped on request, not restarted ($(head -n 1 "$record")); the same" \
                 "command resumes from the latest checkpoint" >&2
            rm -rf "$dir"
            trap - TERM
            return 0
        fi
        if [ -n "$stop_signal" ]; then
            echo "run_with_restarts: SIG$stop_signal received, not restarted (without --exit-signal-handler" \
                 "the ranks end at once; the latest checkpoint is the last one saved)" >&2
            rm -rf "$dir"
            trap - TERM
            return 143
        fi
        if [ "$status" -eq 0 ]; then
            rm -rf "$dir"
            trap - TERM
            return 0
        fi
        record=""
        for kind in refused repeatable; do
            record=$(find "$dir" -maxdepth 1 -name "rank*.$kind" 2>/dev/null | sort | head -n 1)
            [ -n "$record" ] && break
        done
        if [ -n "$record" ]; then
            if [ "$kind" = refused ]; then status=2; else status=3; fi
            if [ "${RESTART_ANY_FAILURE:-0}" != 1 ]; then
                local ranks
                ranks=$(find "$dir" -maxdepth 1 -name "rank*.$kind" | wc -l)
                echo "run_with_restarts: not restarted ($kind on $ranks rank(s) of this node; the same command" \
                     "would fail again; RESTART_ANY_FAILURE=1 restarts anyway): $(head -n 1 "$record")" >&2
                rm -rf "$dir"
                trap - TERM
                return "$status"
            fi
            echo "run_with_restarts: $(head -n 1 "$record")" >&2
        fi
        rm -rf "$dir"
        if [ "$status" -eq 2 ] && [ -z "$record" ] && [ "${RESTART_ANY_FAILURE:-0}" != 1 ]; then
            trap - TERM
            return 2   # refused before any rank started (torchrun's own flags)
        fi
        if [ "$attempt" -ge "${MAX_RESTARTS:-0}" ]; then
            trap - TERM
            return "$status"
        fi
        attempt=$((attempt + 1))
        echo "run_with_restarts: exit status $status; restart $attempt of ${MAX_RESTARTS} from the latest checkpoint" >&2
        sleep "${RESTART_DELAY_S:-3}"
        if [ -n "$stop_signal" ]; then
            echo "run_with_restarts: SIG$stop_signal received, not restarted" >&2
            trap - TERM
            return 143
        fi
    done
}
