"""loss.z_loss (trainer/model/loss.py): the z-loss equals its formula, z_loss * mean over the tokens that count
of logsumexp(logits)^2, on a hand-made batch, for loss=full and loss=chunked, with the gradient of that
formula; off by default, and off the losses are bitwise those of the plain cross-entropy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import WORLD, materialized, run_steps, tiny_config
from trainer.config import ConfigError, LossConfig
from trainer.model.loss import LossTerms, chunked_cross_entropy, full_loss
from trainer.rank.loop import build_trainee

# Two sequences of three tokens over a vocabulary of 4; the last target ignored (data.packing=document's -100).
LOGITS = torch.tensor(
    [
        [[2.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0], [10.0, -3.0, 1.0, 2.0]],
        [[-2.0, 1.0, 3.0, 0.0], [1.5, 1.5, -0.5, 4.0], [0.0, 7.0, 0.0, -7.0]],
    ]
)
TARGETS = torch.tensor([[0, 3, 0], [2, 1, -100]])
WEIGHT = 1e-4


def by_hand() -> tuple[float, float]:
    """(mean cross-entropy, z-loss) written out from the definitions, in float64, token by token."""
    ce, z, count = 0.0, 0.0, 0
    for row, target in zip(LOGITS.flatten(0, 1).tolist(), TARGETS.flatten().tolist()):
        if target == -100:
            continue
        lse = math.log(sum(math.exp(v) for v in row))
        ce += lse - row[target]
        z += lse**2
        count += 1
    return ce / count, WEIGHT * z / count


def test_full_loss_z_loss_equals_its_formula_with_its_gradient() -> None:
    logits = LOGITS.clone().requires_grad_()
    terms = full_loss(logits, TARGETS, WEIGHT)
    ce, z = by_hand()
    assert terms.z_loss is not None
    assert terms.cross_entropy.item() == pytest.approx(ce, rel=1e-6)
    assert terms.z_loss.item() == pytest.approx(z, rel=1e-6)
    (terms.cross_entropy + terms.z_loss).backward()
    reference = LOGITS.clone().requires_grad_()
    lse = reference.logsumexp(-1).flatten()
    counted = TARGETS.flatten() != -100
    expected = F.cross_entropy(reference.flatten(0, 1), TARGETS.flatten()) + WEIGHT * (
        lse[counted].square().mean()
    )
    expected.backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-6, atol=1e-8)


def test_chunked_z_loss_equals_the_full_one() -> None:
    """Chunks of 4 of the 6 tokens (two, the last short): the same terms and gradients as loss=full."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 3, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    full = full_loss(hidden @ weight.T, TARGETS, WEIGHT)
    assert full.z_loss is not None
    (full.cross_entropy + full.z_loss).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = LossTerms.of_chunked(chunked_cross_entropy(hidden, weight, TARGETS, 4, WEIGHT), WEIGHT)
    assert chunked.z_loss is not None
    assert chunked.cross_entropy.item() == pytest.approx(full.cross_entropy.item(), rel=1e-6)
    assert chunked.z_loss.item() == pytest.approx(full.z_loss.item(), rel=1e-6)
    (chunked.cross_entropy + chunked.z_loss).backward()
    torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, grads[1], rtol=1e-5, atol=1e-7)


def test_off_by_default_and_bitwise_the_plain_cross_entropy() -> None:
    assert LossConfig().z_loss == 0.0
    plain = F.cross_entropy(LOGITS.float().flatten(0, 1), TARGETS.flatten())
    off = full_loss(LOGITS, TARGETS)
    assert off.z_loss is None and torch.equal(off.cross_entropy, plain)
    hidden, weight = torch.randn(2, 3, 5), torch.randn(4, 5)
    chunked = chunked_cross_entropy(hidden, weight, TARGETS, 4)
    assert LossTerms.of_chunked(chunked, 0.0).z_loss is None and chunked.shape == ()


def test_losses_off_are_those_of_a_job_without_the_key_and_on_they_differ(process_group: None) -> None:
    """Three steps of the tiny model: z_loss=0 trains bitwise as the default; z_loss=1e-2 adds its term."""
    losses = {}
    for z in (None, 0.0, 1e-2):
        config = tiny_config() if z is None else tiny_config(loss__z_loss=z)
        losses[z] = run_steps(build_trainee(config, WORLD), config, 1, 3)
    assert losses[0.0] == losses[None]
    # loss/train is the cross-entropy alone: the first step's is the same, to fp32 rounding (summed otherwise)
    assert losses[1e-2][0] == pytest.approx(losses[None][0], abs=1e-6)
    assert losses[1e-2][1:] != losses[None][1:]  # the z-loss's gradient changed the weights


def test_a_negative_weight_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^loss.z_loss must be >= 0, got -1e-05$"):
        tiny_config(loss__z_loss=-1e-5)


def test_the_model_returns_both_terms_when_given_targets() -> None:
    """loss=chunked: the decoder's forward takes the weight from apply_loss_choice."""
    config = tiny_config(loss__kind="chunked", loss__chunk_tokens=16, loss__z_loss=WEIGHT)
    model = materialized(config.model)
    model.loss_chunk_tokens, model.loss_z_weight = 16, WEIGHT
    tokens = torch.randint(0, config.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    terms = LossTerms.of_chunked(model(tokens, tokens), WEIGHT)
    expected = full_loss(model(tokens), tokens, WEIGHT)
    assert terms.z_loss is not None and expected.z_loss is not None
    assert terms.z_loss.item() == pytest.approx(expected.z_loss.item(), rel=1e-5)
