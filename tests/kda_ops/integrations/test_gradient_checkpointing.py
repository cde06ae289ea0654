"""Gradient checkpointing of the six transformers hybrid models with ``enable()``, reentrant
and not: a training step's gradients equal the same step without checkpointing, the
checkpointed layers recompute through the kda ops in the backward pass, and the gradients
are close to the unpatched model's (transformers' PyTorch reference functions)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import kda_ops.integrations as integrations
from tests.kda_ops.integrations.models import BUILDERS, VOCAB, transformers_reference
from tests.kda_ops.integrations.test_transformers import OpRecorder

# The forward ops of a training step (the chunked delta rule that saves what its backward
# needs): a checkpointed layer runs them again in the backward pass.
RECOMPUTED_OPS = {"kda.chunk_train", "kda.causal_conv1d", "kda.gated_rms_norm"}


def _training_step(net: torch.nn.Module, record: bool = False):
    """One causal-LM loss's gradients by parameter name (and the ops the backward ran)."""
    prompt = torch.randint(3, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))
    net.zero_grad(set_to_none=True)
    loss = net(prompt, labels=prompt, use_cache=False).loss
    recorder = OpRecorder()
    if record:
        with recorder:
            loss.backward()
    else:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return grads, recorder.ops


@pytest.fixture(scope="module", params=list(BUILDERS))
def reference(request):
    """The model in training mode, its patched step's gradients without checkpointing and
    the unpatched model's."""
    name = request.param
    net = BUILDERS[name]().train()
    with transformers_reference(name):
        unpatched, _ = _training_step(net)
    integrations.enable([name])
    try:
        plain, ops = _training_step(net, record=True)
    finally:
        integrations.disable()
    # Without checkpointing the backward only differentiates: no forward op reruns.
    assert not ops & RECOMPUTED_OPS, ops
    return name, net, plain, unpatched


# transformers 5 renames the switch (activation_checkpointing_enable); the old name is the
# one users call and still works.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(en|dis)able` is deprecated")
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpointed_gradients_equal_plain_step(reference, use_reentrant):
    name, net, plain, unpatched = reference
    integrations.enable([name])
    net.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
    )
    try:
        checkpointed, ops = _training_step(net, record=True)
    finally:
        net.gradient_checkpointing_disable()
        integrations.disable()
    assert ops >= RECOMPUTED_OPS, ops
    assert checkpointed.keys() == plain.keys() == unpatched.keys()
    # The parameters whose gradient is zero (unrouted MoE experts, say) are the same ones.
    assert len(plain) > 0
    for key, grad in checkpointed.items():
        named = lambda message, key=key: f"{key}: {message}"  # noqa: E731
        # The recomputed forward is the same computation: the same gradients, bit for bit.
        torch.testing.assert_close(grad, plain[key], rtol=0, atol=0, msg=named)
        torch.testing.assert_close(grad, unpatched[key], msg=named)
