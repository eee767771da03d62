"""Speculation through the engine on a tiny model: sampled tokens keep their distribution, seeded requests
repeat, logprobs and stop strings are those without speculation, n > 1 and max_tokens hold."""

from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams

NUM_SAMPLES = 1500


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """Without and with speculation, and a prompt of the model's own greedy tokens: one-token prompt lookup
    then drafts what the model tends to say, so that sampled drafts are often accepted and often not."""
    folder = str(tiny_llama_dir[0])
    common = dict(kv_cache_memory="32MiB", enforce_eager=True)
    plain = LLM(folder, **common)
    spec = LLM(folder, **common, speculative_method="ngram", speculative_adaptive=False, speculative_max_rows=4096,
               prompt_lookup_min=1, prompt_lookup_max=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    chain = plain.generate([{"prompt_token_ids": [5, 6, 7]}], greedy)[0].outputs[0].token_ids
    return plain, spec, {"prompt_token_ids": [5, 6, 7] + chain}


def _histograms(llm: LLM, prompt: dict, seed_base: int) -> torch.Tensor:
    """[4 positions, vocab] counts of the first four sampled tokens over NUM_SAMPLES seeded samples."""
    params = [SamplingParams(temperature=0.5, top_k=5, max_tokens=4, ignore_eos=True, seed=seed_base + i)
              for i in range(NUM_SAMPLES)]
    outputs = llm.generate([prompt] * NUM_SAMPLES, params)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outputs])  # [samples, 4]
    vocab = llm.engine.vocab_size
    return torch.stack([torch.bincount(tokens[:, t], minlength=vocab) for t in range(4)]).double()


def _homogeneity_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two histograms come from one distribution (rare tokens pooled in one cell)."""
    rare = (a + b) < 10
    a = torch.cat([a[~rare], a[rare].sum(0, keepdim=True)])
    b = torch.cat([b[~rare], b[rare].sum(0, keepdim=True)])
    cells = (a + b) > 0
    a, b = a[cells], b[cells]
    expected_a = (a + b) * a.sum() / (a.sum() + b.sum())
    expected_b = (a + b) * b.sum() / (a.sum() + b.sum())
    statistic = ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
    dof = torch.tensor(float(cells.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def test_sampled_tokens_keep_their_distribution(engines):
    plain, spec, prompt = engines
    before = spec.engine.stats().spec_decode
    with_spec, without = _histograms(spec, prompt, 0), _histograms(plain, prompt, 10**6)
    after = spec.engine.stats().spec_decode
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > NUM_SAMPLES and 0 < accepted < drafted  # drafts were verified, some kept, some not
    for position in range(4):
        assert _homogeneity_p_value(with_spec[position], without[position]) > 1e-3


def test_seeded_samples_repeat_with_speculation(engines):
    _, spec, prompt = engines
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3, n=3)
    first = [c.token_ids for c in spec.generate([prompt], params)[0].outputs]
    crowd = spec.generate([prompt] * 5, [SamplingParams(temperature=1.0, max_tokens=12, seed=9)] * 4 + [params])
    assert [c.token_ids for c in crowd[-1].outputs] == first and len({tuple(t) for t in first}) == 3
    assert all(len(t) == 12 for t in first)


def test_logprobs_stop_strings_and_max_tokens_as_without_speculation(engines):
    plain, spec, prompt = engines
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True)
    ours, theirs = spec.generate([prompt], params)[0].outputs[0], plain.generate([prompt], params)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids and len(ours.logprobs) == 20
    for mine, reference in zip(ours.logprobs, theirs.logprobs):
        assert mine.keys() == reference.keys()
        assert all(abs(mine[t].logprob - reference[t].logprob) < 1e-4 for t in mine)
    stop = plain.get_tokenizer().decode(theirs.token_ids[5:7])
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True)
    ours, theirs = spec.generate([prompt], params)[0].outputs[0], plain.generate([prompt], params)[0].outputs[0]
    assert (ours.text, ours.token_ids, ours.finish_reason) == (theirs.text, theirs.token_ids, "stop")
    cache = spec.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks


def test_reset_caches_forgets_cached_prompts_and_finished_requests(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB", enforce_eager=True, block_size=4,
              speculative_method="suffix")
    prompt = {"prompt_token_ids": list(range(3, 23))}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    hits = llm.engine.stats().num_prefix_hit_tokens
    proposer = llm.engine.runner.proposer  # the runner hears of a finished request with the next step
    llm.generate([prompt], params)
    assert len(proposer.cached) == 1  # the first request (with its output) is in the suffix trie
    assert proposer.global_trie.count(prompt["prompt_token_ids"] + first[:3]) == 1
    assert llm.engine.stats().num_prefix_hit_tokens > hits
    hits = llm.engine.stats().num_prefix_hit_tokens
    llm.reset_caches()
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    assert not proposer.cached and proposer.global_trie.nodes_in_use() == 0  # the second was forgotten too
    assert llm.engine.stats().num_prefix_hit_tokens == hits  # nothing left to hit


def test_one_runner_step_drafts_for_all_its_requests_in_one_call(engines):
    """After each step the runner proposes the drafts of every request that sampled in one call, from the tokens the
    user got (prompt and output so far, no rejected draft among them), and the next step verifies those drafts."""
    _, spec, prompt = engines
    engine, proposer = spec.engine, spec.engine.runner.proposer
    calls, submitted, collected = [], [], []
    propose, submit, collect = proposer.propose, engine.executor.submit, engine.executor.collect

    def recording_propose(requests, max_num_tokens):
        calls.append({request_id: list(token_ids) for request_id, token_ids in requests})
        return propose(requests, max_num_tokens)

    proposer.propose = recording_propose
    engine.executor.submit = lambda output: submitted.append(output) or submit(output)
    engine.executor.collect = lambda: collected.append(collect()) or collected[-1]
    try:
        prompts = [{"prompt_token_ids": [first] + prompt["prompt_token_ids"]} for first in (1, 2, 3)]
        outputs = spec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    finally:
        del proposer.propose, engine.executor.submit, engine.executor.collect
    assert len(calls) == len(collected) and len(calls[0]) == 3  # one call per step; the first: the three prefills
    expected = {p["prompt_token_ids"][0]: (p["prompt_token_ids"], o.outputs[0].token_ids)
                for p, o in zip(prompts, outputs)}  # by the first token, which tells the prompts apart
    for call in calls:
        for tokens in call.values():
            prompt_ids, output_ids = expected[tokens[0]]
            num_outputs = len(tokens) - len(prompt_ids)
            assert num_outputs > 0 and tokens == prompt_ids + output_ids[:num_outputs]
    assert sum(bool(r.draft_token_ids) for r in collected) >= 2  # (prompt lookup of one token finds drafts)
    for runner_output, next_step in zip(collected, submitted[1:]):
        for s in next_step.scheduled:
            drafts = runner_output.draft_token_ids.get(s.request_id, [])
            assert s.num_draft_tokens <= len(drafts)
            assert s.token_ids[len(s.token_ids) - s.num_draft_tokens :] == drafts[: s.num_draft_tokens]
