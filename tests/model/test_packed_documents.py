"""Packed documents (`K3ForCausalLM.forward(position_ids=…)`, `Policy.final_hidden(position_ids=…)`): several
documents in one row, each computed exactly as if it were alone — KDA and short-conv states reset at every
document start, MLA attends within the document, RoPE restarts at 0 — in float64 on the tiny hybrid (KDA + MLA,
AttnRes, MoE), both MLA position modes. Rows hold documents whose lengths are not multiples of the 64-token
KDA chunk, a 1-token document, right padding (its own document, or continuing the last one's positions) and a
row that is one document; the summed `nll` loss and every parameter gradient equal the sums over the documents
run alone."""

from __future__ import annotations

import pytest
import torch
from k3_factory import make_config, make_model

from k3rl.model.policy import Policy, load_policy

PAD = 0
# Row 0: four documents (one of a single token); row 1: two documents and right padding as its own document;
# row 2: one document followed by padding whose positions continue it (no boundary in that row).
ROWS = [([70, 1, 33, 26], 0), ([57, 45], 28), ([100], 30)]
T = 130


def _model(nope: bool):
    # Layers 2 and 4 are MLA (RoPE with a small base, so positions matter), 1 and 3 KDA; layers 2-4 are MoE.
    return make_model(make_config(num_hidden_layers=4, kda_layers=(1, 3), mla_use_nope=nope, rope_theta=300.0),
                      seed=4)


def _batch(seed: int = 0):
    """(input_ids [B, T], position_ids [B, T], documents: list of (row, start, ids)), padding id PAD."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(ROWS), T), PAD, dtype=torch.long)
    pos = torch.zeros(len(ROWS), T, dtype=torch.long)
    docs = []
    for b, (lengths, pad) in enumerate(ROWS):
        assert sum(lengths) + pad == T
        start = 0
        for n in lengths:
            doc = torch.randint(3, 97, (n,), generator=g)
            ids[b, start:start + n], pos[b, start:start + n] = doc, torch.arange(n)
            docs.append((b, start, doc))
            start += n
        # Padding: its own document (positions from 0), or in the last row the last document continued.
        pos[b, start:] = torch.arange(pad) + (start if b == len(ROWS) - 1 else 0)
    return ids, pos, docs


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_packed_forward_equals_each_document_alone(nope):
    model = _model(nope)
    ids, pos, docs = _batch()
    with torch.no_grad():
        packed = model(ids, position_ids=pos, return_hidden_states=True)
        for b, start, doc in docs:
            alone = model(doc[None], return_hidden_states=True)
            n = len(doc)
            torch.testing.assert_close(packed.hidden_states[b, start:start + n], alone.hidden_states[0],
                                       atol=1e-10, rtol=1e-10, msg=f"row {b} document at {start}")
            torch.testing.assert_close(packed.logits[b, start:start + n], alone.logits[0], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_packed_nll_loss_and_gradients_equal_separate_documents(nope):
    """Summed token losses (the mean times the number of targets; the model masks the targets across
    document boundaries itself) and every parameter gradient: packed batch = sum over documents alone."""
    model = _model(nope)
    ids, pos, docs = _batch(seed=1)
    labels = ids.clone()
    for b, (_lengths, pad) in enumerate(ROWS):
        labels[b, T - pad:] = -100
    params = [p for p in model.parameters() if p.requires_grad]

    out = model(ids, position_ids=pos, labels=labels)
    n_targets = sum(len(doc) - 1 for _, _, doc in docs)
    packed_loss = out.loss * n_targets
    packed_grads = torch.autograd.grad(packed_loss, params, allow_unused=True)

    ref_loss = 0.0
    for _, _, doc in docs:
        if len(doc) > 1:
            ref_loss = ref_loss + model(doc[None], labels=doc[None]).loss * (len(doc) - 1)
    ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)

    torch.testing.assert_close(packed_loss, ref_loss, atol=1e-10, rtol=1e-10)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, packed_grads, ref_grads):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=name)
    assert sum(a is not None for a in packed_grads) > 0.9 * len(params)


def test_policy_final_hidden_packed_k3():
    """The learner's path: `final_hidden(rows=…, position_ids=…)` + chunked log-probs equal each document alone."""
    policy = Policy(_model(nope=False))
    ids, pos, docs = _batch(seed=2)
    rows = torch.zeros_like(ids, dtype=torch.bool)
    for b, start, doc in docs:
        rows[b, start:start + len(doc) - 1] = True
    with torch.no_grad():
        hidden = policy.final_hidden(ids, attention_mask=(ids != PAD).long(), rows=rows, position_ids=pos)
        logp = policy.selected_logprobs(hidden, torch.cat([doc[1:] for _, _, doc in docs]), chunk_size=17)
        ref = [policy.selected_logprobs(policy.final_hidden(doc[None])[0, :-1], doc[1:], chunk_size=17)
               for _, _, doc in docs]
    torch.testing.assert_close(logp, torch.cat(ref), atol=1e-10, rtol=1e-10)


def test_policy_final_hidden_packed_hf(tiny_qwen3_dir):
    """A transformers model gets the same packing from the same position_ids (attention_mask left out)."""
    policy = load_policy(tiny_qwen3_dir)
    vocab = policy.model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    lengths = [13, 1, 20]
    docs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    ids = torch.cat([*docs, torch.zeros(6, dtype=torch.long)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths + [6]])[None]
    with torch.no_grad():
        packed = policy.final_hidden(ids, attention_mask=(ids != 0).long(), position_ids=pos)
        start = 0
        for doc in docs:
            alone = policy.final_hidden(doc[None])
            torch.testing.assert_close(packed[0, start:start + len(doc)], alone[0], atol=1e-5, rtol=1e-4)
            start += len(doc)


def test_no_boundary_is_the_plain_path():
    """position_ids without a restart in any row give exactly the plain forward (no mask, no varlen)."""
    model = _model(nope=False)
    ids = torch.randint(3, 97, (2, 40))
    with torch.no_grad():
        plain = model(ids).logits
        given = model(ids, position_ids=torch.arange(40).expand(2, 40)).logits
    assert torch.equal(plain, given)


def test_bad_position_ids():
    model = _model(nope=True)
    ids = torch.randint(3, 97, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=pos, use_cache=True)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=pos, cache=model.new_cache(2))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=pos[:, :8])
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=pos.double())
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=pos - 1)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=pos + model.config.max_position_embeddings)


def test_make_step_marks_documents_and_positions():
    """RoPE is relative, so restarted positions cannot show in the outputs (above): the step must carry the
    given positions, the documents of each row and their boundaries laid end to end."""
    from k3rl.model.cache import make_step

    _, pos, _ = _batch()
    step = make_step((len(ROWS), T), "cpu", None, None, 4096, pos)
    assert torch.equal(step.positions, pos)
    assert step.documents[0].unique_consecutive(return_counts=True)[1].tolist() == [70, 1, 33, 26]
    assert step.documents[1].unique_consecutive(return_counts=True)[1].tolist() == [57, 45, 28]
    assert step.documents[2].tolist() == [0] * T
    assert step.cu_seqlens.tolist() == [0, 70, 71, 104, 130, 187, 232, 260, 390]
    assert step.attn_mask().shape == (len(ROWS), 1, T, T)
