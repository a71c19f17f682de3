"""mCLIP Stage-1 batches (spec §3, §9 test 14): language pairs drawn with beta = 0.2 smoothing,
batches counted in tokens, one direction per batch."""

import math
from collections import Counter

import pytest
from worlds import QUICK_BACKBONES

from ccr.datamodules.parallel_batches import (
    parallel_batches,
    smoothed_pair_probabilities,
    token_batches,
)

# MT6 training pairs (millions), spec §3; each is used in both directions
MT6 = {"cs": 8.1, "de": 41.0, "es": 20.0, "ja": 8.6, "ru": 20.0, "zh": 22.6}
MT6_BETA_02 = {"cs": 0.1425, "de": 0.1970, "es": 0.1707, "ja": 0.1442, "ru": 0.1707, "zh": 0.1749}


def words(texts):
    return [len(t.split()) for t in texts]


def corpus(sizes, length=3):
    """``{(src, tgt): [(src_text, tgt_text)]}`` with ``sizes[(src, tgt)]`` pairs of ``length`` words."""
    return {
        pair: [
            (" ".join([f"{pair[0]}{i}"] * length), " ".join([f"{pair[1]}{i}"] * length))
            for i in range(size)
        ]
        for pair, size in sizes.items()
    }


def test_mt6_pair_probabilities_with_beta_point_two_match_the_spec():
    sizes = {(a, b): int(MT6[lang] * 1e6) for lang in MT6 for a, b in (("en", lang), (lang, "en"))}
    q = smoothed_pair_probabilities(sizes, 0.2)
    for lang, expected in MT6_BETA_02.items():
        assert q["en", lang] + q[lang, "en"] == pytest.approx(expected, abs=1e-4), lang
    assert sum(q.values()) == pytest.approx(1.0)
    proportional = smoothed_pair_probabilities(sizes, 1.0)
    assert proportional["en", "de"] * 2 == pytest.approx(41.0 / sum(MT6.values()))


@pytest.mark.parametrize("beta", [0.0, 1.5])
def test_beta_outside_zero_one_is_refused(beta):
    with pytest.raises(ValueError, match="beta"):
        smoothed_pair_probabilities({("en", "de"): 3}, beta)


def test_batches_are_drawn_per_direction_with_the_smoothed_probabilities():
    sizes = {("en", "de"): 4000, ("de", "en"): 4000, ("en", "cs"): 40, ("cs", "en"): 40}
    batches = parallel_batches(corpus(sizes), batch_size=1, seed=0, beta=0.2).batches
    assert len(batches) == sum(sizes.values())  # an epoch keeps the number of batches of one pass
    drawn = Counter((src, tgt) for src, tgt, _ in batches)
    q = smoothed_pair_probabilities(sizes, 0.2)
    small = (drawn["en", "cs"] + drawn["cs", "en"]) / len(batches)
    expected = q["en", "cs"] + q["cs", "en"]  # 0.28 (in proportion to size it would be 0.0099)
    sigma = math.sqrt(expected * (1 - expected) / len(batches))
    assert abs(small - expected) < 4 * sigma
    texts = corpus(sizes)
    for src, tgt, pairs in batches:  # one direction per batch, its own sentences
        assert set(pairs) <= set(texts[src, tgt])


def test_without_beta_every_batch_is_used_once_in_proportion_to_size():
    sizes = {("en", "de"): 40, ("en", "cs"): 8}
    batches = parallel_batches(corpus(sizes), batch_size=4, seed=0).batches
    assert Counter((s, t) for s, t, _ in batches) == {("en", "de"): 10, ("en", "cs"): 2}
    assert sorted(p for *_, pairs in batches for p in pairs) == sorted(
        p for t in corpus(sizes).values() for p in t
    )


def test_a_run_of_the_same_seed_draws_the_same_batches():
    sizes = {("en", "de"): 50, ("en", "cs"): 5}
    first = parallel_batches(corpus(sizes), batch_size=2, seed=3, beta=0.2).batches
    assert first == parallel_batches(corpus(sizes), batch_size=2, seed=3, beta=0.2).batches
    assert first != parallel_batches(corpus(sizes), batch_size=2, seed=4, beta=0.2).batches


def test_token_batches_fill_up_to_the_budget_counting_the_longest_item():
    cut = token_batches([2, 3, 3, 4, 4, 9], max_tokens=12)
    assert cut == [
        [0, 1, 2],
        [3, 4],
        [5],
    ]  # 3 x 3 = 9 (a fourth: 4 x 4 = 16); 2 x 4 = 8 (3 x 9 = 27)
    with pytest.raises(ValueError, match="13 tokens exceeds max_tokens=12"):
        token_batches([2, 13], max_tokens=12)


def test_token_counted_batches_hold_more_short_sentences_than_long_ones():
    texts = {("en", "de"): [("a " * n, "b " * n) for n in [2] * 60 + [10] * 60]}
    batches = parallel_batches(
        texts, batch_size=8, seed=0, max_tokens=40, count_tokens=words
    ).batches
    sizes = Counter()
    for _, _, pairs in batches:
        longest = max(max(len(s.split()), len(t.split())) for s, t in pairs)
        assert len(pairs) * longest <= 40
        sizes[longest] += len(pairs)
    per_batch = {
        n: [len(p) for *_, p in batches if max(len(s.split()) for s, _ in p) == n] for n in (2, 10)
    }
    assert max(per_batch[2]) == 20 and max(per_batch[10]) == 4  # not data.batch_size sentences
    assert sizes == {2: 60, 10: 60}  # nothing lost


def test_the_target_side_counts_when_it_is_the_longer_one():
    texts = {("en", "de"): [("a", "b " * 10)] * 8}
    batches = parallel_batches(
        texts, batch_size=8, seed=0, max_tokens=20, count_tokens=words
    ).batches
    assert [len(pairs) for *_, pairs in batches] == [2, 2, 2, 2]


def test_the_datamodule_serves_token_counted_smoothed_batches(tmp_path):
    from ccr.experiments.config import compose
    from ccr.experiments.train import build_datamodule

    cfg = compose(
        [
            "method=mclip",
            f"data.root={tmp_path}",
            "data.synthetic.num_train=48",
            *QUICK_BACKBONES,
            "data.synthetic.num_val=4",
            "data.synthetic.num_test=4",
            "data.batch_size=8",
            "data.synthetic.num_pretrain=48",
            "data.num_workers=0",
            "data.tokenizer.vocab_size=400",
            "data.languages=[en,de,ja]",
        ]
    )
    dm = build_datamodule(cfg, roles=("train",))
    loader = dm.parallel_dataloader(beta=0.2, max_tokens=200)
    batches = list(loader)
    assert len(batches) == len(loader.dataset)
    assert any(len(b["src_input_ids"]) > 8 for b in batches)  # not data.batch_size sentences
    for batch in batches:
        longest = max(
            batch["src_attention_mask"].sum(1).max(), batch["tgt_attention_mask"].sum(1).max()
        )
        assert len(batch["src_input_ids"]) * int(longest) <= 200
        assert "en" in (batch["src_language"], batch["tgt_language"])


def test_each_sentence_is_tokenised_once_however_often_the_loader_is_built(tmp_path, monkeypatch):
    """Token counting tokenised the whole corpus once per direction and again for every stage
    (the English side five times over on the default world): minutes before Stage 1 began."""
    from ccr.experiments.config import compose
    from ccr.experiments.train import build_datamodule

    cfg = compose(
        [
            "method=mclip",
            f"data.root={tmp_path}",
            *QUICK_BACKBONES,
            "data.synthetic.num_train=16",
            "data.synthetic.num_val=4",
            "data.synthetic.num_test=4",
            "data.synthetic.num_pretrain=40",
            "data.batch_size=8",
            "data.num_workers=0",
            "data.tokenizer.vocab_size=300",
            "data.languages=[en,de,ja]",
        ]
    )
    dm = build_datamodule(cfg, roles=("train",))
    first = [
        (b["src_language"], b["src_input_ids"].tolist())
        for b in dm.parallel_dataloader(beta=0.2, max_tokens=200)
    ]
    tokenise, seen = dm.tokenizer.__class__.__call__, []

    def counting(self, texts, max_length):
        seen.extend(texts)
        return tokenise(self, texts, max_length)

    monkeypatch.setattr(dm.tokenizer.__class__, "__call__", counting)
    loader = dm.parallel_dataloader(beta=0.2, max_tokens=200)
    assert seen == []  # every count known from the first build
    assert [(b["src_language"], b["src_input_ids"].tolist()) for b in loader] == first
