"""Speculative decoding: proposers guess the next few tokens of running sequences cheaply, one
target forward pass verifies them all, and rejection sampling keeps the output distribution
exactly the target's (greedy: exactly its tokens).

    config.py      the settings, from `EngineArgs`
    proposer.py    the `Proposer` interface and what it returns
    ngram.py       prompt lookup: the continuation of the latest earlier match of the last n tokens
    draft.py       a smaller model with the same tokenizer, its own paged KV cache and blocks
    batches.py     `ForwardBatch`es of several tokens per sequence (verify, draft catch-up)
    target.py      the target's sampling distribution at every verified position
    rejection.py   acceptance: min(1, p/q), residual max(0, p - q), bonus token
    acceptance.py  when a request (or batch) speculates: the low-acceptance fallback
    stats.py       proposed, accepted, accepted-length histogram per proposer
    speculator.py  one decode step done as propose -> verify -> accept -> roll back
"""
