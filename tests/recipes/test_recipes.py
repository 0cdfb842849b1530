"""Every recipe builds, with NeMo's defaults, and overrides reach the typed configs."""

import fiddle as fdl
import pytest
from nemo_run.cli.cli_parser import parse_cli_args

import recipes
from tokenizer_posttrain.network import resolve_name
from tokenizer_posttrain.training.config import DataConfig, ModelConfig, TrainerConfig
from tokenizer_posttrain.training.train import train

FACTORIES = {
    "cosmos_finetune": (recipes.cosmos_finetune.cosmos_finetune, "CV8x8x8"),
    "cv8x8x8": (recipes.cv8x8x8.cv8x8x8, "CV8x8x8"),
    "dv8x16x16": (recipes.dv8x16x16.dv8x16x16, "DV8x16x16"),
    "tiny": (recipes.tiny.tiny, "CV8x8x8"),
    "tiny_dv": (recipes.tiny.tiny_dv, "DV8x16x16"),
    "tiny_wan21": (recipes.wan21.tiny_wan21, "Wan2.1-VAE"),
    "wan21": (recipes.wan21.wan21, "Wan2.1-VAE"),
    "tiny_wan22": (recipes.wan22.tiny_wan22, "Wan2.2-VAE"),
    "wan22": (recipes.wan22.wan22, "Wan2.2-VAE"),
}


@pytest.mark.parametrize("factory", sorted(FACTORIES))
def test_every_recipe_builds(factory: str) -> None:
    fn, model = FACTORIES[factory]
    built = fdl.build(fn())
    assert built.func is train
    assert resolve_name(built.keywords["model"].model) == model
    assert isinstance(built.keywords["data"], DataConfig)


def test_gpu_recipes_use_nemo_defaults() -> None:
    kw = fdl.build(recipes.cv8x8x8.cv8x8x8()).keywords
    data, trainer = kw["data"], kw["trainer"]
    assert (data.global_batch_size, data.micro_batch_size, data.frames, data.height) == (8, 1, 33, 256)
    assert trainer == TrainerConfig()  # devices auto, gpu, ddp, bf16-mixed, 10000 epochs, val every 100
    assert (
        trainer.precision,
        trainer.max_epochs,
        trainer.val_check_interval,
        trainer.limit_val_batches,
        trainer.log_every_n_steps,
        trainer.checkpoint_every_n_steps,
        trainer.checkpoint_keep,
    ) == ("bf16-mixed", 10000, 100, 1, 1, 100, 3)
    assert kw["resume"].resume_if_exists and kw["resume"].resume_past_end
    # NeMo's defaults plus the compiled, channels-last step as CUDA graphs (eager on a CPU: see train()).
    assert kw["model"] == ModelConfig(
        model="Cosmos-1.0-Tokenizer-CV8x8x8", compile=True, cuda_graphs=True, channels_last=True
    )


def test_the_wan22_recipes_checkpoint_activations_on_a_gpu_and_stay_tiny_on_a_cpu() -> None:
    from tokenizer_posttrain.network import get_config
    from tokenizer_posttrain.training.train import check_clip_shape, check_loss_clips

    gpu, cpu = (fdl.build(fn()).keywords for fn in (recipes.wan22.wan22, recipes.wan22.tiny_wan22))
    assert gpu["model"] == ModelConfig(
        model="Wan2.2-VAE",
        compile=True,
        cuda_graphs=True,
        channels_last=True,
        sample_posterior=True,
        activation_checkpointing=True,
    )
    for kw in (gpu, cpu):
        check_clip_shape(kw["model"], kw["data"])  # 1 + 4k frames, sides multiples of 16
        check_loss_clips(kw["model"], kw["data"], kw["loss"])
    # model.channels scales the decoder's width with the encoder's (160 -> 256 released): 8 -> 12.
    tiny = get_config(cpu["model"].model, channels=cpu["model"].channels)
    assert (tiny.channels, tiny.dec_channels, cpu["loss"].weights_at(0)) == (8, 12, {"l1": 1.0, "kl": 1e-6})


@pytest.mark.parametrize("factory", ["wan21", "tiny_wan21"])
def test_the_wan_recipes_train_a_posterior_sample_under_the_kl_term(factory: str) -> None:
    from tokenizer_posttrain.training.train import check_clip_shape, check_loss_clips

    kw = fdl.build(FACTORIES[factory][0]()).keywords
    model, data, loss = kw["model"], kw["data"], kw["loss"]
    assert model.sample_posterior and loss.kl.weight == 1e-6
    check_clip_shape(model, data)  # 1 + 4k frames, sides multiples of 8
    check_loss_clips(model, data, loss)
    if factory == "wan21":  # cv8x8x8's GPU settings, data and trainer
        cv = fdl.build(recipes.cv8x8x8.cv8x8x8()).keywords
        assert model == ModelConfig(
            model="Wan2.1-VAE", compile=True, cuda_graphs=True, channels_last=True, sample_posterior=True
        )
        assert (data, kw["trainer"], kw["optim"]) == (cv["data"], cv["trainer"], cv["optim"])
        assert loss.weights_at(0) == {"l1": 1.0, "perceptual": 0.1, "kl": 1e-6}
        assert kw["log"].name == "wan21_vae"
    else:  # tiny's CPU run at width 8, without the VGG16
        tiny = fdl.build(recipes.tiny.tiny()).keywords
        assert (model.channels, model.compile, loss.weights_at(0)) == (8, False, {"l1": 1.0, "kl": 1e-6})
        assert (data, kw["trainer"]) == (tiny["data"], tiny["trainer"])
        assert kw["log"].name == "tiny_wan21"


def test_overrides_reach_the_configs() -> None:
    task = parse_cli_args(
        recipes.cv8x8x8.cv8x8x8(),
        [
            "model.model=Cosmos-0.1-Tokenizer-DV8x16x16",
            "model.jit_ckpt_pth=/ckpt",
            "data.path=/data",
            "trainer.max_steps=7",
            "trainer.devices=2",
            "optim.lr=3e-5",
            "data.micro_batch_size=2",
        ],
    )
    kw = fdl.build(task).keywords
    assert kw["model"].jit_ckpt_pth == "/ckpt" and resolve_name(kw["model"].model) == "DV8x16x16"
    assert (kw["data"].path, kw["data"].micro_batch_size) == ("/data", 2)
    assert (kw["trainer"].max_steps, kw["trainer"].devices, kw["optim"].lr) == (7, "2", 3e-5)


def test_workflow_recipes_build() -> None:
    from recipes.workflows import evaluate_recipe, posttrain_recipe
    from tokenizer_posttrain.evaluation.evaluate import evaluate
    from tokenizer_posttrain.workflow.posttrain import posttrain

    built = fdl.build(evaluate_recipe("ckpt", "data", baseline="base"))
    assert built.func is evaluate and built.keywords["baseline"] == "base"
    built = fdl.build(posttrain_recipe("base", "videos", "out", sweep=True))
    assert built.func is posttrain and built.keywords["sweep"] is True and built.keywords["frames"] == 33


@pytest.mark.parametrize(
    ("overrides", "l1", "perceptual"),
    [
        (["loss.perceptual_weight=0.3", "loss.l1_weight=0.7"], (0.7, [], []), (0.3, [], [])),
        (["loss.perceptual.weight=0.2", "loss.perceptual.weights_path=/vgg.pth"], (1.0, [], []), (0.2, [], [])),
        (
            ["loss.perceptual.boundaries=[100]", "loss.perceptual.values=[0.0,0.1]", "loss.perceptual.frame_chunk=4"],
            (1.0, [], []),
            (0.1, [100], [0.0, 0.1]),
        ),
    ],
)
def test_loss_overrides_reach_the_terms(overrides: list[str], l1: tuple, perceptual: tuple) -> None:
    loss = fdl.build(parse_cli_args(recipes.cv8x8x8.cv8x8x8(), overrides)).keywords["loss"]
    assert (loss.l1.weight, loss.l1.boundaries, loss.l1.values) == l1
    assert (loss.perceptual.weight, loss.perceptual.boundaries, loss.perceptual.values) == perceptual
    if "loss.perceptual.frame_chunk=4" in overrides:
        assert loss.perceptual.frame_chunk == 4 and loss.weights_at(99) == {"l1": 1.0}
        assert loss.weights_at(100) == {"l1": 1.0, "perceptual": 0.1}


# NeMo's tokenizer/losses/config.py: weight of each term at steps 0, 249999, 250000, 499999, 500000.
NEMO_SCHEDULE_STEPS = (0, 249999, 250000, 499999, 500000)
NEMO_SCHEDULES = {
    "l1": (1.0, 1.0, 1.0, 1.0, 1.0),
    "perceptual": (0.1, 0.1, 0.1, 0.1, 0.073),
    "gram": (0.0, 0.0, 0.0, 0.0, 0.062),
    "flow": (0.0, 0.0, 0.01, 0.01, 0.01),
    "high_freq": (0.0, 0.0, 0.0, 0.0, 0.0),
    "consistency": (0.0, 0.0, 0.0, 0.0, 0.0),
    "kl": (0.0, 0.0, 0.0, 0.0, 0.0),  # a VAE's term: Cosmos has no posterior
    "latent_anchor": (0.0, 0.0, 0.0, 0.0, 0.0),  # ours, not NeMo's: off unless asked
}


def test_cosmos_finetune_has_nemos_loss_and_the_cv8x8x8_run() -> None:
    from tokenizer_posttrain.losses import TERMS

    kw = fdl.build(recipes.cosmos_finetune.cosmos_finetune()).keywords
    loss = kw["loss"]
    assert set(NEMO_SCHEDULES) == set(TERMS)
    for name, weights in NEMO_SCHEDULES.items():
        assert tuple(loss.term(name).weight_at(step) for step in NEMO_SCHEDULE_STEPS) == weights, name
    assert (loss.flow.raft, loss.flow.scale, loss.flow.dtype, loss.flow.weights_path) == ("large", 2, "bfloat16", None)
    assert (loss.flow.flow_updates, loss.flow.checkpoint_activations) == (12, False)
    assert not loss.high_freq.ever_on and not loss.consistency.ever_on
    # The rest is the cv8x8x8 recipe's (but the run's name).
    cv = fdl.build(recipes.cv8x8x8.cv8x8x8()).keywords
    for group in ("model", "data", "trainer", "optim", "resume"):
        assert kw[group] == cv[group], group
    assert kw["log"].name == "cosmos_finetune_cv8x8x8"
    other = fdl.build(recipes.cosmos_finetune.cosmos_finetune(model_name="Cosmos-1.0-Tokenizer-DV8x16x16")).keywords
    assert resolve_name(other["model"].model) == "DV8x16x16" and other["loss"] == loss


def test_overrides_reach_the_cosmos_finetune_loss() -> None:
    overrides = [
        "loss.flow.boundaries=[1000]",
        "loss.flow.raft=small",
        "loss.flow.weights_path=/raft.pth",
        "loss.gram.values=[0.0,0.5]",
        "loss.high_freq.weight=0.2",
        "trainer.max_steps=2000",
    ]
    kw = fdl.build(parse_cli_args(recipes.cosmos_finetune.cosmos_finetune(), overrides)).keywords
    loss = kw["loss"]
    assert (loss.flow.boundaries, loss.flow.values, loss.flow.raft) == ([1000], [0.0, 0.01], "small")
    assert (loss.flow.weights_path, loss.flow.scale, loss.flow.dtype) == ("/raft.pth", 2, "bfloat16")
    assert (loss.gram.boundaries, loss.gram.values) == ([500000], [0.0, 0.5])
    assert loss.weights_at(999) == {"l1": 1.0, "perceptual": 0.1, "high_freq": 0.2}
    assert loss.weights_at(1000) == {"l1": 1.0, "perceptual": 0.1, "high_freq": 0.2, "flow": 0.01}
    assert kw["trainer"].max_steps == 2000
    assert any("loss.gram.boundaries=[500000]" in note for note in loss.unreached_changes(2000))


@pytest.mark.parametrize("factory", sorted(FACTORIES))
def test_every_loss_term_and_the_gan_take_overrides_in_every_recipe(factory: str) -> None:
    # NeMo-Run cannot set a field inside a dataclass default: each term must be a Config of the recipe's.
    overrides = ["loss.gram.weight=0.5", "loss.flow.raft=small", "loss.high_freq.weight=0.2"]
    overrides += ["loss.consistency.weight=0.3", "loss.gan.weight=0.1", "loss.gan.disc_start=7", "loss.gan.gen_start=9"]
    loss = fdl.build(parse_cli_args(FACTORIES[factory][0](), overrides)).keywords["loss"]
    assert (loss.gram.weight, loss.flow.raft) == (0.5, "small")
    assert (loss.high_freq.weight, loss.consistency.weight) == (0.2, 0.3)
    assert (loss.gan.weight, loss.gan.disc_start, loss.gan.gen_start, loss.gan.channels) == (0.1, 7, 9, 64)


def test_the_recipes_and_posttrain_assemble_the_run_in_one_place() -> None:
    # posttrain builds its training run with run_config's functions and instances; a recipe with the same
    # functions and run.Config: the built recipe is the run posttrain would make from the same settings.
    from tokenizer_posttrain.training import run_config as rc

    built = fdl.build(recipes.tiny.tiny()).keywords
    assert built == rc.train_arguments(
        rc.instance,
        rc.model_config(rc.instance, "CV8x8x8", channels=16),
        rc.data_config(rc.instance, 17, 64, 2, 2, 0),
        rc.trainer_config(rc.instance, 60, "cpu", 20, 20),
        rc.loss_config(rc.instance, perceptual_weight=0.0),
        "tiny_cv8x8x8",
        "outputs",
    )
