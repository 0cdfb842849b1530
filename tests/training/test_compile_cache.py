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
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
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
    assert record["environment"] == environment and record["compile_seconds"] > 0 and record["artifacts"]
    assert (folder / f"{name}.bin").stat().st_size > 0
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


def test_a_file_without_your_signature_is_never_handed_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_load(blob: bytes) -> None:
        raise AssertionError("an unsigned cache reached torch.compiler.load_cache_artifacts")

    monkeypatch.setattr("torch.compiler.load_cache_artifacts", must_not_load)
    folder = tmp_path / cc.FOLDER
    cache = cc.CompileCache(folder, {"shapes": []}, b"k" * 32)
    assert not cache.load()  # nothing there yet
    folder.mkdir()
    cache.blob_path.write_bytes(b"planted code")
    with pytest.warns(UserWarning, match="does not carry your signature"):
        assert not cache.load()  # no record at all
    # Signed with another key (another user's), then a valid signature over other bytes (an altered file).
    for key, blob in ((b"x" * 32, b"planted code"), (b"k" * 32, b"what was signed")):
        signature = cc._signature(key, blob)
        cache.record_path.write_text(json.dumps({"signature": signature}))
        with pytest.warns(UserWarning, match="does not carry your signature"):
            assert not cache.load()


def test_the_signing_key_is_made_private_and_refused_when_others_can_read_it(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "signing.key"
    key = cc.signing_key(path)
    assert len(key) == 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert cc.signing_key(path) == key  # the same key at every launch
    path.chmod(0o644)
    with pytest.raises(PermissionError, match=r"readable by you alone \(chmod 600"):
        cc.signing_key(path)


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
