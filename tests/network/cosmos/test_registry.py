import pytest
import torch

from tokenizer_posttrain import REGISTRY, build_tokenizer, get_config, known_names, resolve_name

# Parameter counts of the released models (architecture doc, section 1.2).
PARAMETERS = {
    "CV4x8x8": 73_192_128,
    "CV8x8x8": 105_653_696,
    "CV8x16x16": 110_898_624,
    "DV4x8x8": 104_669_558,
    "DV8x8x8": 105_653_366,
    "DV8x16x16": 110_898_294,
    "CV4x8x8-LowRes": 110_208_816,
    "DV4x8x8-LowRes": 112_619_766,
}


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_every_registered_model_has_the_published_parameter_count(name: str) -> None:
    with torch.device("meta"):
        net = build_tokenizer(name)
    assert sum(p.numel() for p in net.parameters()) == PARAMETERS[name]


def test_registry_lists_exactly_the_published_models() -> None:
    assert set(REGISTRY) == set(PARAMETERS)


@pytest.mark.parametrize(
    "spelling",
    [
        "Cosmos-1.0-Tokenizer-DV8x16x16",
        "Cosmos-0.1-Tokenizer-DV8x16x16",
        "DV8x16x16",
        "nvidia/Cosmos-1.0-Tokenizer-DV8x16x16",
    ],
)
def test_name_spellings_resolve(spelling: str) -> None:
    assert resolve_name(spelling) == "DV8x16x16"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        resolve_name("Cosmos-1.0-Tokenizer-CV9x9x9")
    for name in known_names():
        assert name in str(err.value)


def test_overrides_are_checked() -> None:
    assert get_config("CV8x8x8", channels=16).channels == 16
    with pytest.raises(ValueError, match="unknown tokenizer config field"):
        get_config("CV8x8x8", chanels=16)
    with pytest.raises(ValueError, match="power of two"):
        get_config("CV8x8x8", spatial_compression=12)
