"""The processes and folders of a job.

- `launch`: the supervising launcher (restarts, hangs, signals);
- `cluster`: who each process is in a multi-node job (torchrun, Slurm), and one job per node;
- `rundir`: run folders (one run at a time, atomic outputs);
- `malloc`: glibc's allocator as a run setting.
"""
