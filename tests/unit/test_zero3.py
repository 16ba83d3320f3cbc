"""FlatShard3 in one process (a stage "replicated" once): gathered for the forward and the backward, freed between.

The collectives with several replicas run on gloo ranks in tests/dist/test_zero3_dist.py; here the same
hooks on one replica must give the plain module's outputs, gradients and updates, with the parameters'
storage empty between uses, also when the backward recomputes a checkpointed region.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpml_compile.errors import HpmlError
from hpml_compile.runtime.observe.held import held_bytes
from hpml_compile.runtime.sync.zero3 import FlatShard3
from hpml_compile.stagecost import memory_parts


class _Net(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.a, x, use_reentrant=False) if self.recompute else self.a(x)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("recompute", [False, True])
def test_gathered_for_forward_and_backward_freed_between(recompute: bool) -> None:
    torch.manual_seed(0)
    ref = _Net(recompute)
    ours = copy.deepcopy(ref)
    sh = FlatShard3(0, list(ours.parameters()), replicas=1, replica=0)
    sh.attach(ours)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1)
    opt = torch.optim.AdamW([sh.param], lr=0.1)
    xs = [torch.randn(4, 6) for _ in range(3)]
    for step in range(2):
        sh.begin_step()
        for x in xs:  # three microbatches: each forward, then each backward, as a GPipe stage runs them
            ref(x).square().mean().backward()
        outs = [ours(x) for x in xs]
        assert all(p.untyped_storage().nbytes() == 0 for p in ours.parameters()), "freed after each forward"
        for out in outs:
            out.square().mean().backward()
            assert not sh.gathered, "freed when each backward ends"
        sh.reduce_scatter(_NoComm())
        torch.testing.assert_close(sh.param.grad, torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
        opt_ref.step()
        opt.step()
        sh.all_gather(_NoComm())
        opt_ref.zero_grad()
        assert sh.gathers == 6, "gathered for every forward and every backward of the step"
    with torch.no_grad():
        torch.testing.assert_close(ours(xs[0]), ref(xs[0]))  # evaluation gathers too
    h = held_bytes(ours, opt)
    assert h.params == sh.param.numel() * 4 and h.grads == 0
    with sh.whole():
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    assert not sh.gathered


def test_whole_changed_writes_the_shard_and_memory_model_counts_the_unit() -> None:
    lin = nn.Linear(3, 2)
    sh = FlatShard3(0, list(lin.parameters()), replicas=1, replica=0)
    with sh.whole(changed=True):
        with torch.no_grad():
            lin.weight.fill_(2.0)
    assert torch.equal(sh.param.detach()[:6], torch.full((6,), 2.0))
    m = memory_parts(param_bytes=1000, activation_bytes=0, input_bytes=0, dtype_bytes=4, replicas=4, zero=3,
                     microbatches=2)
    assert (m.params, m.grads, m.optimizer) == (1250, 1000, 500)
    with pytest.raises(HpmlError, match="one flat buffer"):
        FlatShard3(0, [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))],
                   replicas=2, replica=0)


class _NoComm:
    """One replica: the reduce-scatter of the whole is the whole."""

    def reduce_scatter(self, stage: int, flat: torch.Tensor) -> torch.Tensor:
        return flat


def test_checkpoint_functions_gather_the_shard_and_load_it_back(tmp_path) -> None:
    from hpml_compile.runtime.execute.checkpoint import latest, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    nets = [_Net(False), _Net(False)]
    opts = []
    for net in nets:
        sh = FlatShard3(0, list(net.parameters()), replicas=1, replica=0)
        sh.attach(net)
        opt = torch.optim.AdamW([sh.param], lr=0.1)
        opt.hpml_zero = [sh]  # as the pipeline marks an optimizer over shards
        opts.append(opt)
    sh0 = opts[0].hpml_zero[0]
    sh0.begin_step()
    nets[0](torch.randn(4, 6)).sum().backward()
    sh0.reduce_scatter(_NoComm())
    opts[0].step()
    save_checkpoint(tmp_path, 1, nets[0], opts[0], rng=False)  # whole parameters by name, though freed here
    assert not sh0.gathered
    load_checkpoint(latest(tmp_path), nets[1], opts[1], rng=False)
    assert torch.equal(opts[1].hpml_zero[0].param, sh0.param) and not opts[1].hpml_zero[0].gathered
    state = [o.state[o.param_groups[0]["params"][0]] for o in opts]
    assert torch.equal(state[0]["exp_avg"], state[1]["exp_avg"])


def test_saved_activations_do_not_count_the_gathered_weights() -> None:
    from hpml_compile.saved import SavedActivations

    torch.manual_seed(0)
    plain, ours = _Net(False), _Net(False)
    sh = FlatShard3(0, list(ours.parameters()), replicas=1, replica=0)  # freed before the count starts,
    sh.attach(ours)  # re-allocated at another address for each forward
    x = torch.randn(4, 6)
    peaks = []
    for net in (plain, ours):
        with SavedActivations(exclude=[net]) as acts:
            outs = [net(x) for _ in range(2)]
            peaks.append(acts.peak)
            for out in outs:
                out.sum().backward()
    assert peaks[0] == peaks[1] > 0
