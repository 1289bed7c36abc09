"""The demo's trained model and its little world: the shapes are what they say, the fixed "VAE" round-trips, the
training forward is the family's reference call, training is seeded and learns, and its cache is keyed by the recipe."""
import math
import os
from dataclasses import replace

import pytest
import torch

from sp_lab.cli import demo_training, shapes
from sp_lab.cli.presets import get_preset
from sp_lab.references.qwen_image import reference_forward

# a few seconds on 2 cores: 2 blocks of width 64, 16x16-pixel pictures (16 tokens)
SMALL = demo_training.Recipe(size=dict(num_layers=2, num_attention_heads=4, attention_head_dim=16,
                                       joint_attention_dim=16), image_size=16, steps=60, batch=16,
                             learning_rate=5e-3, warmup_steps=5)


def test_each_shape_covers_its_own_area():
    """At one radius r a circle covers pi r^2, the square (1.7 r)^2, the triangle 0.5 * 2r * 1.8r."""
    count = 64
    generator = torch.Generator().manual_seed(0)
    ids = torch.arange(count) % len(shapes.SHAPES)
    pictures = shapes.draw(ids, torch.zeros(count, dtype=torch.long), 32, generator)  # red on grey
    red = (pictures[:, 0] - pictures[:, 1] > 1.0).float().mean(dim=(1, 2))  # share of strongly red pixels
    generator = torch.Generator().manual_seed(0)
    smallest, largest = shapes.RADIUS
    radius = smallest + (largest - smallest) * torch.rand(count, generator=generator)  # as a share of the side
    expected = torch.tensor([math.pi, 1.7 ** 2, 1.8])[ids] * radius ** 2
    assert torch.allclose(red, expected, rtol=0.15, atol=0.01), (red - expected).abs().max()


def test_the_vae_stand_in_round_trips_and_fills_qwen_image_latents():
    pictures = shapes.draw(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]), 32, torch.Generator().manual_seed(1))
    latents = shapes.encode(pictures)
    assert latents.shape == (3, 16, 1, 16, 16)
    assert torch.equal(latents[:, 12:], torch.zeros_like(latents[:, 12:]))
    assert torch.equal(shapes.decode(latents) * 2 - 1, pictures)


def test_the_context_tells_shapes_and_colours_apart():
    first = shapes.context(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 16)
    again = shapes.context(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 16)
    assert torch.equal(first, again)  # a fixed table: the trained model reads the same vectors at sampling time
    assert torch.equal(first[0, 0], first[1, 0]) and not torch.equal(first[0, 0], first[2, 0])  # shape token
    assert torch.equal(first[0, 1], first[2, 1]) and not torch.equal(first[0, 1], first[1, 1])  # colour token


def test_the_training_forward_is_the_reference_call_the_demo_samples_with():
    from sp_lab.tiny_models import build_tiny_model
    model = build_tiny_model("qwen_image", seed=3, **SMALL.size)  # random weights: every path of the forward counts
    generator = torch.Generator().manual_seed(2)
    latent = torch.randn(2, 16, 1, 8, 8, generator=generator)
    sigma = torch.tensor([0.3, 0.9])
    context = shapes.context(torch.tensor([0, 2]), torch.tensor([3, 1]), 16)
    with torch.no_grad():
        trained_as = demo_training.velocity(model, latent, sigma, context)
    sampled_as = reference_forward(model, latent, sigma, context)
    assert torch.allclose(trained_as, sampled_as, atol=1e-5), (trained_as - sampled_as).abs().max()


@pytest.fixture(scope="module")
def trained():
    return demo_training.train(SMALL)


def test_training_learns(trained):
    _, summary = trained
    loss = summary["loss"]
    assert loss["steps"] == SMALL.steps and len(loss["curve"]) == 10
    # an untrained model stays near its first loss (about 1.5: noise plus picture variance)
    assert loss["last"] < 0.6 * loss["first"], loss
    assert summary["threads"] >= 1 and summary["seconds"] > 0 and summary["digest"] == SMALL.digest()


def test_training_is_seeded(trained):
    model, _ = trained
    again, _ = demo_training.train(replace(SMALL, steps=SMALL.steps))
    for (name, parameter), other in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(parameter, other), name


def test_the_checkpoint_is_cached_by_recipe_and_loads(tmp_path, monkeypatch):
    quick = replace(SMALL, steps=2)
    path = demo_training.trained_checkpoint(quick, str(tmp_path), "small")
    assert os.path.basename(path) == f"small-trained-{quick.digest()}.safetensors"
    assert demo_training.training_summary(path)["loss"]["steps"] == 2

    def no_training(*args):
        raise AssertionError("a cached recipe was trained again")
    monkeypatch.setattr(demo_training, "train", no_training)
    assert demo_training.trained_checkpoint(quick, str(tmp_path), "small") == path
    assert replace(quick, learning_rate=1e-4).digest() != quick.digest()  # any change of the recipe retrains

    from sp_runtime.families.qwen_image import load_model
    model = load_model(path)[0]  # the pool's loader reads it as a Qwen-Image checkpoint
    assert model.config.num_layers == 2 and model.config.in_channels == 64


def test_the_shapes_preset_trains_on_pictures_its_latent_shows():
    recipe = demo_training.recipe_of(get_preset("shapes"))
    assert recipe.image_size == get_preset("shapes").height // 8 * shapes.PIXELS_PER_LATENT == 24
