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
run_with_restarts() {
    local attempt=0 status=0 dir kind record
    while true; do
        dir=$(mktemp -d "${TMPDIR:-/tmp}/tawpipe-exit.XXXXXX")
        status=0
        TAWPIPE_EXIT_DIR="$dir" "$@" || status=$?   # (the scripts run under set -e)
        if [ "$status" -eq 0 ]; then
            rm -rf "$dir"
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
                return "$status"
            fi
            echo "run_with_restarts: $(head -n 1 "$record")" >&2
        fi
        rm -rf "$dir"
        if [ "$status" -eq 2 ] && [ -z "$record" ] && [ "${RESTART_ANY_FAILURE:-0}" != 1 ]; then
            return 2   # refused before any rank started (torchrun's own flags)
        fi
        if [ "$attempt" -ge "${MAX_RESTARTS:-0}" ]; then
            return "$status"
        fi
        attempt=$((attempt + 1))
        echo "run_with_restarts: exit status $status; restart $attempt of ${MAX_RESTARTS} from the latest checkpoint" >&2
        sleep "${RESTART_DELAY_S:-3}"
    done
}
