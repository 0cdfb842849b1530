"""The GAN stage in the training step: today's run until it starts, its logged values, its optimizer and checkpoint
entry, the adaptive weight at the decoder's last layer, decoder-only training against it, and what it refuses."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import fit
from tests.training.conftest import tiny
from tests.training.test_step_guard import Recorder
from tokenizer_posttrain.losses.gan import GANConfig, adaptive_weight, generator_loss
from tokenizer_posttrain.training.adversarial import CHECKPOINT_KEY, RECONSTRUCTION, gan_last_layer
from tokenizer_posttrain.training.config import LoRAConfig, LossConfig, ModelConfig, OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel

SMALL = {"channels": 8, "layers": 2}


def gan_loss(**settings: object) -> LossConfig:
    return LossConfig(perceptual_weight=0.0, gan=GANConfig(**{"weight": 0.5, **SMALL, **settings}))


def splits(module: TokenizerModel, weights: dict[str, float]) -> bool:
    """Whether ``module``'s step at ``weights`` takes the adaptive weight's gradients apart (the split step)."""
    return module.adversarial is not None and module.adversarial.splits(module, weights)


def logged(module: TokenizerModel, tmp_path: Path, steps: int) -> dict[int, dict[str, float]]:
    recorder = Recorder()
    fit(module, tmp_path, steps=steps, logger=recorder, log_every_n_steps=1)
    return {step: row for step, row in recorder.rows if "train/loss" in row}


def test_until_disc_start_the_run_is_todays_run_bit_for_bit(tmp_path: Path) -> None:
    plain = logged(
        TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), LossConfig(perceptual_weight=0.0)), tmp_path, 5
    )
    with_gan = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), gan_loss(disc_start=3, gen_start=3))
    rows = logged(with_gan, tmp_path / "gan", 5)
    assert [rows[s]["train/loss"] for s in range(3)] == [plain[s]["train/loss"] for s in range(3)]
    assert all("train/gan_d" not in rows[s] and "train/gan_g" not in rows[s] for s in range(3))
    for step in (3, 4):
        assert {"train/gan_g", "train/gan_d", "train/d_real", "train/d_fake", "train/gan_weight"} <= set(rows[step])
        assert rows[step]["train/loss"] == pytest.approx(
            rows[step]["train/l1"] + rows[step]["train/gan_weight"] * rows[step]["train/gan_g"], rel=1e-4
        )
    assert rows[4]["train/loss"] != plain[4]["train/loss"]


def test_the_discriminator_trains_with_its_own_optimizer_and_travels_in_checkpoints(tmp_path: Path) -> None:
    module = TokenizerModel(
        tiny("CV8x8x8"), OptimConfig(lr=1e-3), gan_loss(lecam_weight=0.01, r1_weight=1.0, r1_every=2)
    )
    stage = module.adversarial
    assert stage is not None
    before = {k: v.clone() for k, v in stage.discriminator.state_dict().items()}
    recorder = Recorder()
    trainer = fit(module, tmp_path, steps=4, logger=recorder, log_every_n_steps=1)
    rows = [row for _, row in recorder.rows if "train/loss" in row]
    assert all(row["train/lecam"] >= 0 and row["train/gan_d"] > 0 for row in rows)
    assert sum("train/r1" in row for row in rows) == 2  # steps 0 and 2: every r1_every discriminator steps
    assert stage.steps == 4
    after = stage.discriminator.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # Not the tokenizer's: outside its optimizer, its DDP and its state dict.
    tokenizer_params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not tokenizer_params & {id(p) for p in stage.parameters()}
    trainer.save_checkpoint(tmp_path / "gan.ckpt")
    saved = torch.load(tmp_path / "gan.ckpt", map_location="cpu", weights_only=True)
    assert all(key.startswith("network.") for key in saved["state_dict"])
    entry = saved[CHECKPOINT_KEY]
    assert entry["steps"] == 4 and entry["optimizer"]["state"]
    assert entry["discriminator"].keys() == after.keys() and float(entry["lecam"]["updates"]) == 4
    fresh = TokenizerModel(
        tiny("CV8x8x8"), OptimConfig(lr=1e-3), gan_loss(lecam_weight=0.01, r1_weight=1.0, r1_every=2)
    )
    assert fresh.adversarial is not None
    fresh.on_load_checkpoint(saved)
    fresh.adversarial.start(torch.device("cpu"))
    for key, value in after.items():
        assert torch.equal(fresh.adversarial.discriminator.state_dict()[key], value)
    assert fresh.adversarial.steps == 4 and fresh.adversarial.optimizer.state_dict()["state"]


def test_the_adaptive_weight_is_the_gradient_norm_ratio_at_the_decoders_last_layer() -> None:
    module = TokenizerModel(tiny("CV8x8x8"), loss=gan_loss(weight=0.25))
    stage = module.adversarial
    assert stage is not None
    torch.manual_seed(0)
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    mask = torch.ones(1, 1, 9, 32, 32)
    weights = module.loss.prepare(0, video.device)
    terms = module._step_forward(video, mask, weights)
    reconstruction, total = terms[RECONSTRUCTION], terms["loss"]
    assert gan_last_layer(module.network) == "decoder.conv_out.1.conv3d.weight"
    last = module.network.get_parameter("decoder.conv_out.1.conv3d.weight")
    g_loss = generator_loss("hinge", stage.discriminator(reconstruction))
    rec_grad = torch.autograd.grad(total, last, retain_graph=True)[0]
    gan_grad = torch.autograd.grad(g_loss, last, retain_graph=True)[0]
    by_hand = rec_grad.norm() / (gan_grad.norm() + 1e-4) * 0.25
    got = stage.generator_term(reconstruction, total, last, step=0)
    torch.testing.assert_close(got["gan_weight"], by_hand.detach(), rtol=1e-5, atol=0)
    assert got["gan_weight"] == adaptive_weight(total, g_loss, last) * 0.25
    assert all(p.grad is None for p in stage.parameters())  # the generator term leaves the discriminator alone


def test_decoder_only_training_keeps_the_encoder_against_the_gan(tmp_path: Path) -> None:
    module = TokenizerModel(tiny("CV8x8x8", trainable="decoder"), OptimConfig(lr=1e-3), gan_loss())
    encoder = {k: v.clone() for k, v in module.network.encoder.state_dict().items()}
    decoder = {k: v.clone() for k, v in module.network.decoder.state_dict().items()}
    fit(module, tmp_path, steps=2)
    assert all(torch.equal(v, module.network.encoder.state_dict()[k]) for k, v in encoder.items())
    assert any(not torch.equal(v, module.network.decoder.state_dict()[k]) for k, v in decoder.items())


def test_weight_zero_builds_nothing_and_bad_settings_are_named() -> None:
    assert TokenizerModel(tiny("CV8x8x8"), loss=LossConfig(perceptual_weight=0.0)).adversarial is None
    with pytest.raises(ValueError, match=r"loss\.gan\.adaptive compares gradients at the decoder's last layer"):
        TokenizerModel(tiny("CV8x8x8", trainable="encoder"), loss=gan_loss())
    assert TokenizerModel(tiny("CV8x8x8", trainable="encoder"), loss=gan_loss(adaptive=False)).adversarial
    with pytest.raises(ValueError, match=r"loss\.gan\.gen_start"):
        gan_loss(disc_start=5, gen_start=2)


def test_cuda_graphs_stay_with_the_split_step_and_give_way_to_the_whole_pass_with_a_warning() -> None:
    from tokenizer_posttrain.losses.consistency import ConsistencyConfig

    config = ModelConfig(model="CV8x8x8", channels=16, compile=True, cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", r"model\.jit_ckpt_pth is not set")
        split = TokenizerModel(config, loss=gan_loss())  # the adaptive weight's gradients taken apart
        fixed = TokenizerModel(config, loss=gan_loss(adaptive=False))  # no gradient of it at all
    for module in (split, fixed):
        assert module.model_config.replays_cuda_graphs and module.acceleration.cuda_graphs
        assert module.adversarial is not None and module.adversarial.keep_gradients
    windows = LossConfig(
        perceptual_weight=0.0, consistency=ConsistencyConfig(0.5, window=9, step=4), gan=GANConfig(weight=0.5, **SMALL)
    )
    with pytest.warns(UserWarning, match=r"loss\.gan: the training step runs compiled but without CUDA graphs"):
        whole = TokenizerModel(config, loss=windows)
    assert whole.model_config.compile and not whole.model_config.replays_cuda_graphs
    assert whole.adversarial is not None and not whole.adversarial.keep_gradients
    # 16-mixed scales the loss, which the split gradients lack: the whole pass, which CUDA graphs cannot replay.
    split._trainer = SimpleNamespace(precision="16-mixed")
    with pytest.raises(ValueError, match=r"trainer\.precision=16-mixed .* set model\.cuda_graphs=false"):
        split.on_train_start()


def test_under_cuda_graphs_the_discriminators_gradients_stay_allocated_and_are_zeroed_in_place() -> None:
    module = TokenizerModel(tiny("CV8x8x8"), loss=gan_loss())
    stage = module.adversarial
    assert stage is not None
    stage.accelerate(None, channels_last=False, keep_gradients=True)
    stage.start(torch.device("cpu"))
    real, fake = torch.rand(2, 1, 3, 9, 32, 32).unbind(0)
    grads = None
    for _ in range(2):
        stage.discriminator_backward(real, fake, step=0, micro_batches=1)
        now = [p.grad for p in stage.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in now)
        if grads is not None:
            assert all(a is b for a, b in zip(grads, now, strict=True))  # the same tensors, not new ones
        grads = now
        assert stage.optimizer_step() is not None
        assert all(p.grad is g and not g.any() for p, g in zip(stage.parameters(), grads, strict=True))


def test_the_compiled_step_feeds_the_gan_stage_its_adaptive_weight_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aot_eager: AOTAutograd's joint graph and compiled backward (what the adaptive weight's torch.autograd.grad
    # runs through) without Inductor's code generation, which takes minutes on a CPU.
    from tokenizer_posttrain.training import acceleration

    monkeypatch.setattr(acceleration, "COMPILE_BACKEND", "aot_eager")
    compiled = TokenizerModel(tiny("CV8x8x8", compile=True), OptimConfig(lr=1e-3), gan_loss())
    rows = logged(compiled, tmp_path, 1)
    eager = logged(TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), gan_loss()), tmp_path / "eager", 1)
    for step in (0,):
        for name in ("train/loss", "train/gan_weight", "train/gan_d"):
            assert rows[step][name] == pytest.approx(eager[step][name], rel=2e-2), (step, name)


def test_a_run_with_the_gan_exports_the_tokenizer_alone(tmp_path: Path) -> None:
    from safetensors import safe_open

    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.training.train import train

    gan = {"weight": 0.1, **SMALL}
    run_dir = train(**tiny_run(tmp_path, steps=2, log={"export_on_end": True}, loss={"gan": GANConfig(**gan)}))
    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as exported:
        keys = set(exported.keys())
    assert keys and all(key.startswith(("encoder.", "decoder.", "quant", "post_quant")) for key in keys), keys
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved[CHECKPOINT_KEY]["steps"] == 2


def test_adaptive_every_reuses_the_weight_between_recomputations(tmp_path: Path) -> None:
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), gan_loss(adaptive_every=3))
    rows = logged(module, tmp_path, 5)
    weights = [rows[step]["train/gan_weight"] for step in range(5)]
    assert weights[0] == weights[1] == weights[2] and weights[3] == weights[4] and weights[3] != weights[0]
    assert module.adversarial is not None and module.adversarial.adaptive_step == 3
    state = module.adversarial.state_dict()
    assert state["adaptive_step"] == 3 and float(state["adaptive"]) == pytest.approx(weights[3] / 0.5, rel=1e-5)
    with pytest.raises(ValueError, match=r"loss\.gan\.adaptive_every=0 must be >= 1"):
        gan_loss(adaptive_every=0)


@pytest.mark.parametrize("kind", ["patch3d", "patch2d"])
def test_a_compiled_channels_last_discriminator_trains_as_the_plain_one(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The training's speed switches on the discriminator (model.compile, model.channels_last): same logits,
    # same gradients in both of its passes and through R1 (which runs the eager forward: compiled code has no
    # double backward), same state-dict keys. aot_eager: the compiled graphs without Inductor's code generation.
    import copy

    from tokenizer_posttrain.losses import build_loss
    from tokenizer_posttrain.network import build_tokenizer
    from tokenizer_posttrain.training import acceleration
    from tokenizer_posttrain.training.adversarial import AdversarialStage

    monkeypatch.setattr(acceleration, "SEGMENT_BACKEND", "aot_eager")
    config = GANConfig(weight=0.5, discriminator=kind, r1_weight=1.0, r1_every=1, **SMALL)
    network, loss = build_tokenizer("CV8x8x8", channels=8), build_loss(LossConfig(perceptual_weight=0.0))
    plain, fast = AdversarialStage(config, network, loss), AdversarialStage(config, network, loss)
    fast.accelerate(acceleration.compiled_segment, channels_last=True)
    memory_format = torch.channels_last_3d if kind == "patch3d" else torch.channels_last
    assert fast.discriminator.net[0].weight.is_contiguous(memory_format=memory_format)
    assert list(fast.state_dict()["discriminator"]) == list(plain.state_dict()["discriminator"])
    torch.manual_seed(0)
    real, fake = torch.rand(2, 3, 5, 16, 16) * 2 - 1, torch.rand(2, 3, 5, 16, 16) * 2 - 1
    values = {}
    from torch._dynamo.utils import counters

    counters.clear()
    for name, stage in (("plain", plain), ("fast", fast)):
        stage.start(torch.device("cpu"))
        reconstruction = fake.clone().requires_grad_(True)
        g = stage.generator_term(reconstruction, torch.zeros(()), None, step=0)
        g["gan_g"].backward()
        logged = stage.discriminator_backward(real, fake, step=0, micro_batches=1)
        grads = [p.grad.clone() for p in stage.discriminator.parameters()]
        values[name] = (g["gan_g"].detach(), reconstruction.grad, logged["r1"], grads)
    assert counters["stats"]["unique_graphs"] >= 2  # the fast stage's passes ran compiled (G term, D step)
    (g0, rg0, r10, grads0), (g1, rg1, r11, grads1) = values["plain"], values["fast"]
    assert torch.allclose(g0, g1, atol=1e-5) and torch.allclose(rg0, rg1, atol=1e-6)
    assert torch.allclose(r10, r11, rtol=1e-4)
    for a, b in zip(grads0, grads1, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    # A deep copy (the EMA callback copies the LightningModule) judges with its own weights, not the original's.
    twin = copy.deepcopy(fast.discriminator)
    with torch.no_grad():
        before = twin(real)
        for p in fast.discriminator.parameters():
            p.add_(1.0)
        assert torch.equal(twin(real), before) and not torch.allclose(fast.discriminator(real), before)


@pytest.mark.parametrize(
    ("name", "settings"),
    [("CV8x8x8", {}), ("DV8x16x16", {}), ("CV8x8x8", {"trainable": "decoder"}), ("CV8x8x8", {"lora": LoRAConfig(2)})],
    ids=["cv", "dv", "decoder-only", "lora"],
)
def test_the_split_step_has_the_gradients_and_weight_of_the_whole_backward_pass(name: str, settings: dict) -> None:
    # The step before the split: the adaptive weight by autograd through network and loss, then one backward pass.
    torch.manual_seed(1)  # the same LoRA adapters' initial weights in both
    whole = TokenizerModel(tiny(name, **settings), loss=gan_loss(weight=0.25))
    torch.manual_seed(1)
    split = TokenizerModel(tiny(name, **settings), loss=gan_loss(weight=0.25))
    torch.manual_seed(0)
    video = torch.rand(2, 3, 9, 32, 32) * 2 - 1
    mask = torch.ones(2, 1, 9, 32, 32)
    mask[1, :, :, :, 20:] = 0  # a padded clip: the generator term and the loss see the same masked pixels
    weights = whole.loss.prepare(0, video.device)
    assert whole.adversarial is not None and split.adversarial is not None
    assert split.adversarial.splits(split, weights)
    expected = whole.adversarial.add_terms(whole, whole._step_forward(video, mask, weights), video, mask)
    expected["loss"].backward()
    got, backward = split.adversarial.split_step(split, video, mask, weights)
    assert float(backward) == float(got["loss"])  # the stand-in adds nothing to the value
    backward.backward()
    for key in ("loss", "l1", "gan_g", "gan_weight", "gan_d", "d_real", "d_fake"):
        torch.testing.assert_close(got[key].detach(), expected[key].detach(), rtol=1e-5, atol=1e-7, msg=key)
    assert float(got["gan_weight"]) > 0
    pairs = zip(whole.network.named_parameters(), split.network.named_parameters(), strict=True)
    grads = [(n, a.grad, b.grad) for (n, a), (_, b) in pairs if a.requires_grad]
    assert grads and all(b is not None for _, _, b in grads)
    for key, want, have in grads:
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-6, msg=key)
    for want, have in zip(whole.adversarial.parameters(), split.adversarial.parameters(), strict=True):
        torch.testing.assert_close(have.grad, want.grad, rtol=1e-5, atol=1e-7)


def test_the_split_step_is_left_to_the_whole_pass_where_it_does_not_apply() -> None:
    from tokenizer_posttrain.losses.consistency import ConsistencyConfig

    late = TokenizerModel(tiny("CV8x8x8"), loss=gan_loss(disc_start=2, gen_start=2))
    assert not splits(late, late.loss.prepare(0, torch.device("cpu")))  # generator term off
    fixed = TokenizerModel(tiny("CV8x8x8"), loss=gan_loss(adaptive=False))
    assert not splits(fixed, fixed.loss.prepare(0, torch.device("cpu")))

    def windows(**gan: object) -> LossConfig:
        consistency = ConsistencyConfig(0.5, window=9, step=4)
        return LossConfig(perceptual_weight=0.0, consistency=consistency, gan=GANConfig(weight=0.5, **SMALL, **gan))

    with pytest.warns(UserWarning, match=r"adaptive_every=1: with loss\.consistency on.*adaptive_every=8"):
        TokenizerModel(tiny("CV8x8x8"), loss=windows(adaptive_every=1))
    consistent = TokenizerModel(tiny("CV8x8x8"), loss=windows())  # its windows pass through the last layer too
    assert not splits(consistent, consistent.loss.prepare(0, torch.device("cpu")))
    assert consistent.adversarial is not None and consistent.adversarial.adaptive_every(split=False) == 8  # null
    # LoRA dropout would draw another mask in the tail's second run; adapters before the last layer leave it out.
    for lora in (LoRAConfig(2, dropout=0.1), LoRAConfig(2, targets=["decoder.conv_out.0.*"])):
        adapted = TokenizerModel(tiny("CV8x8x8", lora=lora), loss=gan_loss())
        assert not splits(adapted, adapted.loss.prepare(0, torch.device("cpu")))
        assert adapted.adversarial is not None and adapted.adversarial.adaptive_every(split=False) == 8
    split = TokenizerModel(tiny("CV8x8x8", lora=LoRAConfig(2)), loss=gan_loss())
    assert splits(split, split.loss.prepare(0, torch.device("cpu")))
    stage = split.adversarial
    assert stage is not None and stage.last_layer is not None
    assert stage.last_layer.startswith("decoder.conv_out.1.") and stage.adaptive_every(True) == 1
    # 16-mixed (CUDA only; Lightning makes it bf16-mixed on a CPU): the loss scale the split gradients would lack.
    split._trainer = SimpleNamespace(precision="16-mixed")
    assert not splits(split, split.loss.prepare(0, torch.device("cpu")))
    with torch.no_grad():
        plain = TokenizerModel(tiny("CV8x8x8"), loss=gan_loss())
        assert not splits(plain, plain.loss.prepare(0, torch.device("cpu")))


def test_the_gan_stage_trains_under_bf16_true(tmp_path: Path) -> None:
    # bf16 clips and tokenizer weights meet the discriminator's fp32 weights: its inputs are cast to them.
    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.training.train import train

    gan = GANConfig(weight=0.1, **SMALL)
    run_dir = train(**tiny_run(tmp_path, steps=2, trainer={"precision": "bf16-true"}, loss={"gan": gan}))
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved[CHECKPOINT_KEY]["steps"] == 2
    assert all(
        v.dtype == torch.float32 for v in saved[CHECKPOINT_KEY]["discriminator"].values() if v.is_floating_point()
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("adaptive", [True, False], ids=["split", "fixed-weight"])
def test_cuda_graphs_run_the_gan_stage_as_eager_does(adaptive: bool) -> None:
    # Two micro-batches per step, new clips every step, the discriminator's step between: stale CUDA-graph outputs
    # (reconstruction, its gradients, the discriminator's gradients) would show as another clip's numbers.
    from tests.conftest import reference_weights
    from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
    from tokenizer_posttrain.training import acceleration

    weights = str(reference_weights("CV8x8x8"))
    clips = torch.rand(3, 2, 1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)).cuda() * 2 - 1
    mask = torch.ones(1, 1, 9, 32, 32, device="cuda")

    def run(**switches: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], TokenizerModel]:
        cfg = ModelConfig(model="CV8x8x8", jit_ckpt_pth=weights, channels=16, **switches)
        module = TokenizerModel(cfg, loss=gan_loss(lr=1e-30, adaptive=adaptive)).cuda()  # its weights stay put
        stage = module.adversarial
        assert stage is not None
        stage.start(torch.device("cuda"))
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        tokenizer, discriminator = [], []
        for step, micro_batches in enumerate(clips):
            module.optimizer_zero_grad(0, step, optimizer)
            for i, video in enumerate(micro_batches):
                assert splits(module, module.loss.prepare(0, video.device)) == adaptive
                loss = module.training_step({VIDEO: video, LOSS_MASK: mask}, i)
                module.on_before_backward(loss)
                (loss / len(micro_batches)).backward()
            tokenizer.append(torch.cat([p.grad.flatten() for p in module.network.parameters()]))
            discriminator.append(torch.cat([p.grad.flatten() for p in stage.parameters()]))
            assert stage.optimizer_step() is not None
        return tokenizer, discriminator, module

    eager_tok, eager_disc, _ = run()
    skips = acceleration.cuda_graph_skips()
    graphed_tok, graphed_disc, module = run(compile=True, cuda_graphs=True)  # module kept: its graphs live with it
    assert module.acceleration.cuda_graphs and acceleration.cuda_graph_skips() == skips
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(0, create_if_none_exists=False)
    assert manager is not None and len(list(manager.get_roots())) > 0
    for name, eager, graphed in (("tokenizer", eager_tok, graphed_tok), ("discriminator", eager_disc, graphed_disc)):
        for step, (want, got) in enumerate(zip(eager, graphed, strict=True)):
            error = ((got - want).norm() / want.norm()).item()
            assert error < 2e-2, f"{name}, step {step}: relative gradient error {error:.2e}"
