"""The executors render the launch NeMo-Run would run: torchrun locally, an sbatch script on Slurm.

Nothing is launched and no Slurm is needed: NeMo-Run's experiment dry run writes the sbatch script and
the serialized task to the experiment folder, which lives under tmp_path here.
"""

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import fiddle as fdl
import nemo_run as run
import pytest
from nemo_run.config import get_nemorun_home, set_nemorun_home
from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer
from nemo_run.run.torchx_backend.packaging import package

import recipes
from recipes.executors import DEFAULT_ENV_VARS, local_executor, slurm_executor
from tokenizer_posttrain.training.train import train

IMAGE = "nvcr.io/example/tokenizer-posttrain:25.09"
MOUNTS = ["/lustre/data:/data", "/lustre/ckpts:/ckpts", "/lustre/runs:/lustre/runs"]


@pytest.fixture
def nemorun_home(tmp_path: Path) -> Iterator[Path]:
    """NeMo-Run's home (experiment folders, the LocalTunnel's job folders) inside tmp_path."""
    previous = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "nemo_run"))
    yield tmp_path / "nemo_run"
    set_nemorun_home(previous)


def _driving_task() -> run.Partial:
    task = recipes.cv8x8x8.cv8x8x8(name="cv8x8x8_driving", log_dir="/lustre/runs")
    task.model.jit_ckpt_pth = "/ckpts/Cosmos-1.0-Tokenizer-CV8x8x8"
    task.data.path = "/data/driving_energon"
    task.data.global_batch_size = 32  # a multiple of 2 nodes x 8 GPUs
    task.trainer.max_steps = 10000
    return task


def test_slurm_script_for_two_nodes_of_eight_gpus(nemorun_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NeMo-Run creates the job folders through `invoke`, which reads stdin; pytest's stdin raises on read.
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    task = _driving_task()
    executor = slurm_executor(
        account="my_account",
        partition="batch",
        nodes=2,
        devices_per_node=8,
        cpus_per_node=64,
        container_image=IMAGE,
        container_mounts=MOUNTS,
        packager=run.Packager(),  # render without a git checkout
        env_vars={"NCCL_IB_HCA": "mlx5"},
    )
    with run.Experiment("cv8x8x8_driving", executor=executor, log_level="WARN") as exp:
        exp.add(task, name="train")
        exp.dryrun(log=False, delete_exp_dir=False)

    (script_path,) = nemorun_home.rglob("train_sbatch.sh")
    script = script_path.read_text()
    lines = script.splitlines()
    for flag in (
        "--account=my_account",
        "--partition=batch",
        "--nodes=2",
        # NeMo-Run's torchrun launcher: one task per node, which starts the 8 processes
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--cpus-per-task=64",
        "--time=04:00:00",
    ):
        assert f"#SBATCH {flag}" in lines, flag
    assert "# Run with: sbatch --requeue --parsable" in lines
    assert "export NCCL_DEBUG=WARN" in lines and "export NCCL_IB_HCA=mlx5" in lines

    (srun,) = [line for line in lines if line.startswith("srun ")]
    job_dir = script_path.parent / "train"  # what the job sees as /nemo_run
    assert f"--container-image {IMAGE} " in srun
    assert " --cpus-per-task=64 torchrun " in srun  # srun does not inherit it from sbatch (Slurm >= 22.05)
    assert f"--container-mounts {','.join([*MOUNTS, f'{job_dir}:/nemo_run'])} " in srun
    launch = srun[srun.index(" torchrun ") + 1 :].split()
    assert launch[0] == "torchrun"
    torchrun_args = dict(zip(launch[1:-5:2], launch[2:-5:2], strict=True))
    assert torchrun_args["--nnodes"] == "2" and torchrun_args["--nproc-per-node"] == "8"
    assert torchrun_args["--rdzv-endpoint"] == "$head_node_ip:29500" and torchrun_args["--node-rank"] == "$SLURM_NODEID"
    runner = ["-m", "nemo_run.core.runners.fdl_runner", "-n", "train", "/nemo_run/configs/train_fn_or_script"]
    assert launch[-5:] == runner

    # The file the job runs is our train entry with the overrides made above.
    shipped = ZlibJSONSerializer().deserialize((job_dir / "configs" / "train_fn_or_script").read_text())
    assert shipped == task
    built = fdl.build(shipped)
    assert built.func is train
    kw = built.keywords
    assert kw["model"].jit_ckpt_pth == "/ckpts/Cosmos-1.0-Tokenizer-CV8x8x8"
    assert (kw["data"].path, kw["data"].global_batch_size) == ("/data/driving_energon", 32)
    assert kw["trainer"].max_steps == 10000
    assert (kw["log"].log_dir, kw["log"].name) == ("/lustre/runs", "cv8x8x8_driving")


def test_slurm_defaults_submit_from_the_login_node() -> None:
    executor = slurm_executor("acct", "batch")
    assert isinstance(executor.tunnel, run.LocalTunnel) and executor.tunnel.job_dir == ""
    assert isinstance(executor.packager, run.GitArchivePackager)
    assert (executor.nodes, executor.ntasks_per_node, executor.gpus_per_node) == (1, 8, 8)
    assert executor.container_image is None and executor.env_vars == DEFAULT_ENV_VARS
    assert executor.cpus_per_task is None and executor.srun_args is None
    # each call builds its own objects: changing one executor leaves the next alone
    executor.env_vars["X"] = "1"
    executor.container_mounts.append("/a:/a")
    fresh = slurm_executor("acct", "batch")
    assert fresh.env_vars == DEFAULT_ENV_VARS and fresh.container_mounts == []


def test_local_executor_runs_torchrun_with_one_process_per_device() -> None:
    executor = local_executor(devices=2)
    app = package("train", recipes.tiny.tiny(), executor=executor)  # what the executor would start
    (role,) = app.roles
    assert role.entrypoint == "torchrun"
    args = role.args
    assert args[args.index("--nnodes") + 1] == "1"
    assert args[args.index("--nproc-per-node") + 1] == "2"
    assert args[args.index("-m") + 1 : args.index("-n") + 2] == ["nemo_run.core.runners.fdl_runner", "-n", "train"]
    assert ZlibJSONSerializer().deserialize(args[-1]) == recipes.tiny.tiny()
    assert role.env["NCCL_DEBUG"] == "WARN"
