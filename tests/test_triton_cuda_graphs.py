"""The CUDA-graph decode runner's CPU-checkable half: which graph a batch replays, and that the padding rows
its static buffers hold to reach a bucket change nothing (outputs of the real rows, K/V cache), and that the runner takes
decode-only steps from its graphs. Capture and replay themselves need a GPU and run in `make gpu-check`."""
from __future__ import annotations

import pytest
import torch

import ops  # noqa: F401
from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, StaticInputs, graph_key
from engine.models.batch import ForwardBatch
from tiny_models import make_hybrid_checkpoint

pagedserve = torch.ops.pagedserve


def _decode_batch(contexts: list[int], width: int) -> ForwardBatch:
    rows = len(contexts)
    tables = torch.arange(rows * width, dtype=torch.int32).view(rows, width)
    positions = torch.tensor(contexts) - 1
    return ForwardBatch(
        input_ids=torch.arange(rows) + 3, positions=positions,
        slot_mapping=tables[torch.arange(rows), positions // 16].long() * 16 + positions % 16,
        block_tables=tables, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32), logits_indices=torch.arange(rows))


def _forward(batch: ForwardBatch, kv) -> torch.Tensor:
    """A one-layer attention forward made of the pagedserve ops (2 kv heads, head_dim 16)."""
    k_cache, v_cache = kv
    x = torch.sin(batch.input_ids[:, None] * torch.arange(1, 65)).float()
    q, k = pagedserve.rotary(x.view(-1, 4, 16), x[:, :32].reshape(-1, 2, 16), batch.positions,
                             ops.rope_cos_sin(64, 16, 10000.0), 16)
    pagedserve.write_kv(k_cache, v_cache, k, -k, batch.slot_mapping)
    out = pagedserve.paged_attention(q, k_cache, v_cache, batch.query_start_loc, batch.context_lens,
                                     batch.block_tables, 0.25)
    return out.flatten(1)[batch.logits_indices]


def test_padding_rows_leave_outputs_and_cache_unchanged():
    batch = _decode_batch([5, 17, 33], width=3)
    kv = (torch.randn(12, 16, 2, 16), torch.randn(12, 16, 2, 16))
    padded_kv = (kv[0].clone(), kv[1].clone())
    expected = _forward(batch, kv)
    inputs = StaticInputs(batch, rows=8, table_width=4, with_state=True)
    inputs.load(_decode_batch([9, 2, 30, 31, 40, 7], width=4), torch.arange(6, dtype=torch.int32))
    padded = inputs.load(batch, torch.tensor([4, 0, 2], dtype=torch.int32))   # over a bigger step's rows
    actual = _forward(padded, padded_kv)
    torch.testing.assert_close(actual[:3], expected)
    assert torch.equal(padded_kv[0], kv[0]) and torch.equal(padded_kv[1], kv[1])
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert (padded.slot_mapping[3:] == -1).all() and (padded.context_lens[3:] == 0).all()
    assert (padded.block_tables[:, 3] == 0).all() and (padded.block_tables[3:] == 0).all()
    assert inputs.state_slots.tolist() == [4, 0, 2, -1, -1, -1, -1, -1]
    assert padded is inputs.batch       # loaded in place: the graph's buffers, no new tensors


def test_graph_key_buckets_rows_and_width_and_names_every_external_buffer():
    kv = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))]
    key = graph_key(_decode_batch([5, 17, 33], width=3), (kv,))
    assert (key.rows, key.table_width, key.with_state) == (4, 4, False)
    assert key == graph_key(_decode_batch([2, 40, 9, 1], width=4), (kv,))      # same graph fits both
    other_pool = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))]
    assert key != graph_key(_decode_batch([5, 17, 33], width=3), (other_pool,))  # new buffers: new graph
    assert key != graph_key(_decode_batch([5, 17, 33], width=3), (kv,), with_state=True)
    assert key != graph_key(_decode_batch([5, 17, 33], width=5), (kv,))


def test_prefill_steps_and_cpu_tensors_run_eagerly():
    batch = _decode_batch([5, 17], width=2)
    prefill = ForwardBatch(**{**batch.__dict__, "input_ids": torch.arange(3),
                              "query_start_loc": torch.tensor([0, 2, 3], dtype=torch.int32)})
    assert graph_key(prefill, ()) is None
    assert graph_key(_decode_batch([5] * 300, width=1), ()) is None             # past the largest bucket
    assert DecodeGraphs(_forward).run(batch, ()) is None                        # CPU: never captured


class _ReplayByForward:
    """Stands in for DecodeGraphs off a GPU (the real one answers None there): a decode-only batch is
    "replayed" by the forward it wraps, anything else is left to the runner. Records each call."""

    def __init__(self, forward):
        self.forward, self.calls = forward, []

    def run(self, batch, *external, state_slots=None):
        replay = graph_key(batch, external, state_slots is not None) is not None
        self.calls.append((replay, len(external), state_slots))
        if not replay:
            return None
        return self.forward(batch, *external) if state_slots is None else self.forward(batch, *external, state_slots)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_runner_takes_decode_steps_from_its_graphs_and_the_rest_eagerly(tiny_checkpoint, tmp_path, arch):
    path = str(tiny_checkpoint(arch) if arch == "qwen3" else make_hybrid_checkpoint(tmp_path, arch))
    prompts = [list(range(5, 25)), list(range(40, 47))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=64, kv_pool_tokens=512)
    eager = LLM(model=path, **kw).generate(prompts, params)
    llm = LLM(model=path, **kw)
    runner = llm.engine.runner
    assert runner.graphs is None, "CUDA graphs are for GPUs only"
    model_forward, eager_calls = runner.model.forward, []
    runner.model.forward = lambda *a: eager_calls.append(1) or model_forward(*a)
    runner.graphs = graphs = _ReplayByForward(model_forward)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    replayed = sum(r for r, _, _ in graphs.calls)
    assert replayed >= params.max_tokens - 1, "decode steps did not come from the graphs"
    assert len(eager_calls) == len(graphs.calls) - replayed, "a step ran both from a graph and eagerly"
    hybrid = arch == "qwen3_5"
    assert all(n == (2 if hybrid else 1) and (slots is not None) == hybrid for _, n, slots in graphs.calls), \
        "the graphs get the K/V layers, and a hybrid model's state layers and slots too"
