"""kdn-launch as a package: launch/kdn-launch is its command-line entry point.

  util.py    errors, messages, files and HTTP helpers every part uses
  procs.py   the processes of a deployment: liveness, stop order, signals
  plan.py    the deployment plan: model, binaries, devices, CURVE keys
  argv.py    the one builder of every process's command line, for `up` and
             for the Slurm job script alike
  redis_cluster.py  --redis-cluster: the nodes' redis.conf and password, and
             a cluster of them on this machine
  local.py   `up`, `down`, `status` and `--dry-run`: a deployment on this
             machine and its record, RUN_DIR/deployment.json
  demo.py    `demo`'s client: the sample requests it sends
  slurm.py   `slurm submit | status | down`, with the job script rendered from
             job.sbatch (a template)
  cli.py     the flags of every command, and main()

Standard library only, so it runs with any Python 3.8+.
"""
