# Sourced by the launch scripts: run_with_restarts CMD... runs CMD, and after a failure runs it again,
# up to MAX_RESTARTS times. The scripts pass --load with their --save directory, so every new run
# resumes from the latest checkpoint: a dead rank or node costs the iterations since that checkpoint,
# not a manual step. torchrun's own --max-restarts is not used: on this torch version a restarted
# round cannot re-form its process group. Exit status 2 (bad flags, refused before training) is not
# retried. On several nodes every node runs its own loop; they meet again at the next rendezvous.
run_with_restarts() {
    local attempt=0 status=0
    while true; do
        "$@" && return 0
        status=$?
        if [ "$status" -eq 2 ] || [ "$attempt" -ge "${MAX_RESTARTS:-0}" ]; then
            return "$status"
        fi
        attempt=$((attempt + 1))
        echo "run_with_restarts: exit status $status; restart $attempt of ${MAX_RESTARTS} from the latest checkpoint" >&2
        sleep "${RESTART_DELAY_S:-3}"
    done
}
