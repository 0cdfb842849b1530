"""NeMo-Run executors for the training recipes: torchrun on this machine, or torchrun on every node of a Slurm job.

Like the recipes, these are pure functions: they return NeMo-Run executor objects, read nothing from the
environment and start nothing. ``run.run(task, executor=...)`` launches; ``dryrun=True`` prints the command
(or the sbatch script) instead. Any other executor field is set on the returned object
(``executor.exclusive = True``, ``executor.qos = "high"``).

Both use NeMo-Run's torchrun launcher: one torchrun per node starting ``devices`` processes, which
``tokenizer_posttrain.training.train`` reads back (``LOCAL_WORLD_SIZE`` for the devices, ``SLURM_NNODES`` for
the nodes).
"""

from __future__ import annotations

from typing import Optional, Union

import nemo_run as run

# NCCL's own warnings (a wrong interface, a failed IB device) are what explain a multi-node hang; keep them.
DEFAULT_ENV_VARS = {"NCCL_DEBUG": "WARN"}


def _env(env_vars: Optional[dict[str, str]]) -> dict[str, str]:
    return {**DEFAULT_ENV_VARS, **(env_vars or {})}


def local_executor(devices: int = 1, env_vars: Optional[dict[str, str]] = None) -> run.LocalExecutor:
    """``torchrun --nproc-per-node devices`` on this machine (torchrun must be on PATH: activate the venv)."""
    return run.LocalExecutor(ntasks_per_node=devices, launcher="torchrun", env_vars=_env(env_vars))


def slurm_executor(
    account: str,
    partition: str,
    nodes: int = 1,
    devices_per_node: int = 8,
    cpus_per_node: Optional[int] = None,
    container_image: Optional[str] = None,
    container_mounts: Optional[list[str]] = None,
    time: str = "04:00:00",
    tunnel: Optional[Union[run.SSHTunnel, run.LocalTunnel]] = None,
    packager: Optional[run.Packager] = None,
    env_vars: Optional[dict[str, str]] = None,
) -> run.SlurmExecutor:
    """A Slurm job of ``nodes`` x ``devices_per_node`` GPUs; srun starts one torchrun per node.

    Args:
        account, partition: charged account and partition.
        nodes, devices_per_node: the job's shape (GPUs per node = processes per node).
        cpus_per_node: CPUs for the one task per node (torchrun, its workers and their video decoding
            loader workers); None leaves Slurm's default, which on many clusters is one CPU per task.
        container_image: run inside this image (Pyxis/enroot), e.g. one built from docker/Dockerfile;
            None runs on the nodes' own environment (set ``executor.setup_lines`` to activate it).
        container_mounts: ``host:container`` paths, e.g. the data, the checkpoints and ``log.log_dir``.
        time: wall-clock limit.
        tunnel: how to reach the cluster. The default, ``run.LocalTunnel()``, submits from this machine
            (a login node) and keeps the job folders under ``$NEMORUN_HOME/experiments``, which the
            compute nodes must see. ``run.SSHTunnel(host, user, job_dir)`` submits from elsewhere.
        packager: how the code reaches the job; default ``run.GitArchivePackager()``: the committed
            state of this git checkout, extracted into the job's working directory.
        env_vars: exported in the job, on top of ``DEFAULT_ENV_VARS`` (e.g. ``NCCL_IB_HCA``,
            ``NCCL_SOCKET_IFNAME``, ``WANDB_API_KEY``).
    """
    return run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        # NeMo-Run's torchrun launcher turns this into one task per node running
        # `torchrun --nnodes nodes --nproc-per-node devices_per_node`.
        ntasks_per_node=devices_per_node,
        gpus_per_node=devices_per_node,
        cpus_per_task=cpus_per_node,
        # Slurm 22.05 and later do not pass sbatch's --cpus-per-task on to srun: ask again for the step.
        srun_args=None if cpus_per_node is None else [f"--cpus-per-task={cpus_per_node}"],
        launcher="torchrun",
        container_image=container_image,
        container_mounts=list(container_mounts or []),
        time=time,
        # A LocalTunnel with its own job_dir is not filled by NeMo-Run (NVIDIA-NeMo/Run#299): leave it
        # empty so the job folders are the experiment folders under $NEMORUN_HOME.
        tunnel=run.LocalTunnel(job_dir="") if tunnel is None else tunnel,
        packager=run.GitArchivePackager() if packager is None else packager,
        env_vars=_env(env_vars),
    )
