"""The run's compile cache: written after the first step, loaded by a later launch with a fresh Inductor cache
(the requeue case), keyed on everything the graphs depend on, and never loaded without the user's signature."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenizer_posttrain.training import compile_cache as cc
from tokenizer_posttrain.training.config import DataConfig, LossConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[2]

# A Lightning fit of a compiled module on the CPU, with the callback, in a process of its own; prints the
# callback's first line, its summary and Inductor's cache counters as JSON.
FIT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import lightning.pytorch as pl
    import torch
    from torch._dynamo.utils import counters
    from tokenizer_posttrain.training.compile_cache import CompileCache, CompileCacheCallback, signing_key

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            # Matrix products only (extern kernels): Inductor generates no C++ to build, so each launch is quick.
            self.net = torch.nn.Linear(16, 1, bias=False)
            self.step_fn = torch.compile(self.net)

        def training_step(self, batch, batch_idx):
            return self.step_fn(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    folder, environment = Path(sys.argv[1]), json.loads(sys.argv[2])
    callback = CompileCacheCallback(CompileCache(folder, environment, signing_key()), [(9, 16, 16)])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 16)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data)
    print("RESULT " + json.dumps({"summary": callback.summary(), "loaded": callback.loaded,
                                  "inductor": dict(counters["inductor"])}))
    """
)


def fit(tmp_path: Path, name: str, folder: Path, environment: dict) -> tuple[dict, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        # A fresh Inductor cache per process: the node a requeued job lands on.
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor_{name}"),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # no pool of compile workers to start for two small graphs
        cc.KEY_FILE_ENV: str(tmp_path / "home" / "signing.key"),
    }
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    result = subprocess.run(
        [sys.executable, str(script), str(folder), json.dumps(environment)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), result.stdout + result.stderr


def test_a_later_launch_with_a_fresh_inductor_cache_loads_the_compiled_step(tmp_path: Path) -> None:
    folder, environment = tmp_path / "run" / cc.FOLDER, {"shapes": [[9, 16, 16]]}
    first, output = fit(tmp_path, "first", folder, environment)
    assert "compiling the training step for 9x16x16" in output
    assert not first["loaded"] and first["inductor"].get("fxgraph_cache_miss", 0) > 0
    assert first["summary"].startswith("first step: ") and "compiling" in first["summary"]
    name = cc.cache_name(environment)
    record = json.loads((folder / f"{name}.json").read_text())
    assert record["environment"] == environment and record["compile_seconds"] > 0
    assert [part["file"] for part in record["parts"]] == [f"{name}-0.bin"]
    assert (folder / f"{name}-0.bin").stat().st_size > 0
    assert not list(folder.glob("*.partial"))

    second, output = fit(tmp_path, "second", folder, environment)
    assert second["loaded"] and "compile cache: loaded" in output and "when it last compiled" in output
    assert second["inductor"].get("fxgraph_cache_hit", 0) > 0 and second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert "with the compile cache loaded" in second["summary"]
    # It compiled nothing new: the file stays as the first launch wrote it.
    assert json.loads((folder / f"{name}.json").read_text()) == record


def environment(**changes: object) -> dict:
    model = ModelConfig(model="CV8x8x8", compile=True)
    data = DataConfig(frames=17, height=256, width=256)
    env = cc.cache_environment(model, data, LossConfig(), "bf16-mixed", [(17, 256, 256)])
    return {**env, **changes}


def test_the_file_name_follows_everything_the_graphs_depend_on(tmp_path: Path) -> None:
    base = cc.cache_name(environment())
    assert cc.cache_name(environment()) == base
    for change in (
        {"torch": "9.9.9"},
        {"device": "another GPU"},
        {"shapes": [[17, 256, 384]]},
        {"micro_batch_size": 2},
        {"precision": "32-true"},
        {"code": "0" * 16},
    ):
        assert cc.cache_name(environment(**change)) != base, change
    # Where the weights come from is not part of it; what the model is, is.
    model = ModelConfig(model="CV8x8x8", compile=True, jit_ckpt_pth="/somewhere/else")
    data = DataConfig(frames=17, height=256, width=256)
    same = cc.cache_environment(model, data, LossConfig(), "bf16-mixed", [(17, 256, 256)])
    assert cc.cache_name(same) == base
    other = cc.cache_environment(
        ModelConfig(model="CV8x8x8", compile=True, channels=16), data, LossConfig(), "bf16-mixed", [(17, 256, 256)]
    )
    assert cc.cache_name(other) != base
    # The code version is the package's own source.
    assert cc.code_version() == cc.code_version() and len(cc.code_version()) == 16


class FakeInfo:
    """What torch.compiler's save/load return besides the bytes: the names of the artifacts, by kind."""

    def __init__(self, *names: str) -> None:
        self.artifacts = {"inductor": list(names)}


def signed_part(cache: cc.CompileCache, index: int, blob: bytes, key: bytes = b"k" * 32) -> dict:
    file_name = f"{cache.name}-{index}.bin"
    (cache.folder / file_name).write_bytes(blob)
    return {"file": file_name, "signature": cc._signature(key, file_name, blob)}


def write_record(cache: cc.CompileCache, *parts: dict) -> None:
    cache.record_path.write_text(json.dumps({"parts": list(parts)}))


@pytest.fixture
def torch_loads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """torch.compiler.load_cache_artifacts replaced by a list of what reached it (no compiled code here)."""
    reached: list[bytes] = []

    def load(blob: bytes) -> FakeInfo:
        reached.append(blob)
        return FakeInfo(blob.decode())

    monkeypatch.setattr("torch.compiler.load_cache_artifacts", load)
    return reached


def test_a_file_without_your_signature_is_never_handed_to_torch(tmp_path: Path, torch_loads: list[bytes]) -> None:
    folder = tmp_path / cc.FOLDER
    folder.mkdir()
    cache = cc.CompileCache(folder, {"shapes": []}, b"k" * 32)
    assert not cache.load()  # nothing there yet
    cases = {
        "another user's key": signed_part(cache, 2, b"planted", key=b"x" * 32),
        "altered after signing": {**signed_part(cache, 0, b"signed"), "file": f"{cache.name}-0.bin"},
    }
    (folder / f"{cache.name}-0.bin").write_bytes(b"altered")
    # A blob signed for another environment (another cache name), renamed into this one.
    other = cc.CompileCache(folder, {"shapes": [[1, 2, 3]]}, b"k" * 32)
    replayed = signed_part(other, 0, b"other environment")
    (folder / f"{cache.name}-1.bin").write_bytes(b"other environment")
    cases["replayed from another cache"] = {"file": f"{cache.name}-1.bin", "signature": replayed["signature"]}
    for what, part in cases.items():
        write_record(cache, part)
        with pytest.warns(UserWarning, match="does not carry your signature"):
            assert not cache.load(), what
    assert torch_loads == []
    # A record naming files outside the cache is reduced to nothing.
    write_record(cache, {"file": "../../.bashrc", "signature": "0"}, {"file": f"{cache.name}-0.bin"})
    assert cache.record()["parts"] == []


def test_unreadable_or_odd_files_are_skipped_with_a_warning(tmp_path: Path, torch_loads: list[bytes]) -> None:
    folder = tmp_path / cc.FOLDER
    folder.mkdir()
    cache = cc.CompileCache(folder, {}, b"k" * 32)
    victim = tmp_path / "victim"
    victim.write_bytes(b"victim")
    link = {"file": f"{cache.name}-0.bin", "signature": cc._signature(b"k" * 32, f"{cache.name}-0.bin", b"victim")}
    (folder / link["file"]).symlink_to(victim)  # signed bytes, but reached through a link: not read
    directory = {"file": f"{cache.name}-1.bin", "signature": "0"}
    (folder / directory["file"]).mkdir()
    fifo = {"file": f"{cache.name}-2.bin", "signature": "0"}
    os.mkfifo(folder / fifo["file"])  # would block a plain read forever
    good = signed_part(cache, 3, b"good")
    write_record(cache, link, directory, fifo, good)
    with pytest.warns(UserWarning, match="could not load the compile cache") as caught:
        assert cache.load()  # the good part still loads
    assert len(caught) == 3 and torch_loads == [b"good"]


def test_torch_failing_to_load_a_signed_part_is_not_a_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / cc.FOLDER
    folder.mkdir()
    cache = cc.CompileCache(folder, {}, b"k" * 32)
    write_record(cache, signed_part(cache, 0, b"from another torch"))
    monkeypatch.setattr("torch.compiler.load_cache_artifacts", lambda blob: None)  # torch logs and gives up
    with pytest.warns(UserWarning, match="could not load the compile cache"):
        assert not cache.load()

    def broken(blob: bytes) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr("torch.compiler.load_cache_artifacts", broken)
    with pytest.warns(UserWarning, match=r"disk full\); compiling afresh"):
        assert not cache.load()


def test_a_launch_that_compiles_more_adds_a_part_and_the_next_loads_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_loads: list[bytes]
) -> None:
    folder = tmp_path / cc.FOLDER
    recorded = [(b"a", FakeInfo("a"))]
    monkeypatch.setattr("torch.compiler.save_cache_artifacts", lambda: recorded[-1])
    first = cc.CompileCache(folder, {"shapes": []}, b"k" * 32)
    assert first.save(compile_seconds=98.04)
    assert not first.save()  # nothing new
    # A later launch loads part 0, then meets an aspect bucket: torch's new recording holds only what this
    # process hit or compiled, so it becomes a part of its own and part 0 stays.
    second = cc.CompileCache(folder, {"shapes": []}, b"k" * 32)
    assert second.load() and torch_loads == [b"a"]
    recorded.append((b"b", FakeInfo("b")))
    assert second.save()
    record = json.loads(first.record_path.read_text())
    assert [p["file"] for p in record["parts"]] == [f"{first.name}-0.bin", f"{first.name}-1.bin"]
    assert record["compile_seconds"] == 98.0  # the first compile's time, kept
    third = cc.CompileCache(folder, {"shapes": []}, b"k" * 32)
    assert third.load() and torch_loads == [b"a", b"a", b"b"]


def test_saving_never_writes_through_a_planted_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / cc.FOLDER
    folder.mkdir()
    cache = cc.CompileCache(folder, {}, b"k" * 32)
    victims = {name: tmp_path / f"victim_{i}" for i, name in enumerate((f"{cache.name}.json", f"{cache.name}-0.bin"))}
    for name, victim in victims.items():
        victim.write_text("precious")
        (folder / name).symlink_to(victim)
    (folder / f"{cache.name}.json.partial").symlink_to(tmp_path / "victim_0")  # an old fixed temporary name
    monkeypatch.setattr("torch.compiler.save_cache_artifacts", lambda: (b"blob", FakeInfo("a")))
    assert cache.save(1.0)
    assert all(victim.read_text() == "precious" for victim in victims.values())
    assert (
        not (folder / f"{cache.name}-0.bin").is_symlink() and (folder / f"{cache.name}-0.bin").read_bytes() == b"blob"
    )
    assert not cache.record_path.is_symlink()


def test_a_failing_save_warns_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Rank0:
        is_global_zero = True

    def broken() -> None:
        raise RuntimeError("cannot pickle")

    monkeypatch.setattr("torch.compiler.save_cache_artifacts", broken)
    callback = cc.CompileCacheCallback(cc.CompileCache(tmp_path / cc.FOLDER, {}, b"k" * 32), [])
    with pytest.warns(UserWarning, match=r"could not write to .*cannot pickle\); training on"):
        callback.on_train_end(Rank0(), None)  # type: ignore[arg-type]


def test_the_signing_key_is_made_private_and_refused_when_others_can_read_it(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "signing.key"
    key = cc.signing_key(path)
    assert len(key) == 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert cc.signing_key(path) == key  # the same key at every launch
    path.chmod(0o644)
    with pytest.raises(PermissionError, match=r"only you can read and write \(chmod 600"):
        cc.signing_key(path)
    path.chmod(0o600)
    path.parent.chmod(0o777)  # others could swap the key file
    with pytest.raises(PermissionError, match="can be written by others"):
        cc.signing_key(path)
    path.parent.chmod(0o700)
    path.write_bytes(b"short")
    with pytest.raises(PermissionError, match="shorter than 16 bytes"):
        cc.signing_key(path)
    assert not list(path.parent.glob("*.partial"))


def test_where_the_cache_goes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert cc.cache_folder(ModelConfig(compile=True), run) == run / cc.FOLDER
    assert (
        cc.cache_folder(ModelConfig(compile=True, compile_cache=str(tmp_path / "shared")), run) == tmp_path / "shared"
    )
    assert cc.cache_folder(ModelConfig(compile=True, compile_cache="none"), run) is None
    assert cc.cache_folder(ModelConfig(compile=False), run) is None  # nothing compiles: nothing to keep
    with pytest.raises(ValueError, match="model.compile_cache"):
        ModelConfig(compile_cache=" ")


def test_compile_cache_none_builds_nothing_and_reads_no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cc.KEY_FILE_ENV, str(tmp_path / "key"))
    model = ModelConfig(compile=True, compile_cache="none")
    assert cc.compile_cache_callback(model, DataConfig(), LossConfig(), "bf16-mixed", tmp_path, []) is None
    assert not (tmp_path / "key").exists() and not (tmp_path / cc.FOLDER).exists()


def test_each_later_clip_shape_is_announced_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    class Rank0:  # the one Trainer attribute the batch hooks read
        is_global_zero = True
        sanity_checking = False

    callback = cc.CompileCacheCallback(cc.CompileCache(tmp_path / cc.FOLDER, {}, b"k" * 32), [(9, 16, 16)])
    trainer = Rank0()
    for shape in ((9, 16, 16), (9, 16, 16), (9, 16, 24), (9, 16, 24), (9, 16, 16)):
        batch = {"video": torch.zeros(1, 3, *shape)}
        callback.on_train_batch_start(trainer, None, batch, 0)  # type: ignore[arg-type]
        callback.on_train_batch_end(trainer, None, None, batch, 0)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.count("first 9x16x24 clip: compiling the training step") == 1
    assert "9x16x16 clip" not in out  # the first shape was announced at launch
    assert callback.first_step_seconds is not None


def test_a_compiled_run_gets_its_callback_with_the_run_folder_and_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cc.KEY_FILE_ENV, str(tmp_path / "home" / "key"))
    model = ModelConfig(model="CV8x8x8", compile=True)
    shapes = [(17, 256, 256), (17, 256, 384)]
    callback = cc.compile_cache_callback(model, DataConfig(frames=17), LossConfig(), "bf16-mixed", tmp_path, shapes)
    assert callback is not None and callback.cache.folder == tmp_path / cc.FOLDER
    assert callback.cache.environment["shapes"] == [[17, 256, 256], [17, 256, 384]]
    assert (tmp_path / "home" / "key").stat().st_size == 32  # the key is made at launch, not at the first save
    assert not (tmp_path / cc.FOLDER).exists()  # nothing written before there is something compiled


def test_train_announces_and_reports_the_cache_of_a_compiled_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # train() itself, with the step captured by Dynamo on the CPU (backend "eager": no Inductor code to generate,
    # so nothing to save either): the launch line and the summary line come from the run's own callback.
    import torch

    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.training import acceleration
    from tokenizer_posttrain.training import train as train_module

    plain = acceleration.compile_module_call
    monkeypatch.setattr(acceleration, "compile_module_call", lambda fn, mode=None: plain(fn, backend="eager"))
    monkeypatch.setattr(train_module, "resolve_compile", lambda model, accelerator: model)  # the CPU keeps compile
    monkeypatch.setenv(cc.KEY_FILE_ENV, str(tmp_path / "home" / "key"))
    torch._dynamo.reset()
    # train() sets Dynamo's global optimize_ddp for compiled runs: restored for the tests that follow.
    with torch._dynamo.config.patch(optimize_ddp=torch._dynamo.config.optimize_ddp):
        try:
            run_dir = train_module.train(**tiny_run(tmp_path, steps=2, model={"compile": True}))
        finally:
            torch._dynamo.reset()
    out = capsys.readouterr().out
    assert "compiling the training step for 9x32x32: minutes the first time;" in out
    assert f"later launches of this run load it from {run_dir / cc.FOLDER}" in out
    assert "first step: " in out and f"(compiling; cache: {run_dir / cc.FOLDER})" in out
