#!/bin/sh
# Slurm Epilog for prefetchd's Slurm recipe (examples/slurm/train.sbatch): removes the job's ring
# from the node's RAM however the job ended. slurmd runs the Epilog as root on each node of a job
# once its processes are gone, also after a step was killed outright (SIGKILL when KillWait runs
# out, the OOM killer), which leaves /dev/shm/prefetchd-$SLURM_JOB_ID behind: batches of up to
# buffer.max_bytes that would hold the node's memory until a reboot.
#
#   slurm.conf:  Epilog=/etc/slurm/epilog.d/*   (install this file there, mode 0755)
#
# Without it, the next job of the same user on the node removes such rings when it starts.
# A recipe run with PREFETCHD_RUN_DIR set elsewhere: set it here too.
set -eu
rm -rf -- "${PREFETCHD_RUN_DIR:-/dev/shm}/prefetchd-${SLURM_JOB_ID:?}"
