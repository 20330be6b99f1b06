"""The embedded default model: every id decodes to printable text, it continues the text it
was trained on, n-gram drafts are accepted on it at a realistic rate, and making it on first use
says so and shows its progress."""

from __future__ import annotations

from tpspec import LLM, SamplingParams
from tpspec.runtime.generate_cli import DEFAULT_PROMPTS
from tpspec.runtime.llm import tiny_model_path
from tpspec.runtime.tokenizer import load_tokenizer


def test_every_id_decodes_to_printable_text():
    tok = load_tokenizer(tiny_model_path())
    special = set(tok.all_special_ids)
    assert len(tok) == 512
    for i in range(len(tok)):
        if i in special:
            continue
        text = tok.decode([i])
        assert text and "\ufffd" not in text and text.replace("\n", " ").isprintable(), (i, text)


def test_continues_its_text_and_accepts_ngram_drafts(monkeypatch):
    monkeypatch.setenv("TPSPEC_NUM_THREADS", "1")
    with LLM("tiny", tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        out = llm.generate(["Once upon a time there was", "The capital of France is"],
                           SamplingParams(temperature=0, max_tokens=24))
        # The demo's prompts repeat themselves, as real text often does: prompt lookup finds drafts.
        llm.generate(DEFAULT_PROMPTS, SamplingParams(temperature=0, max_tokens=32))
        stats = llm.last_stats
    texts = [o.outputs[0].text for o in out]
    assert texts[0].startswith(" a "), texts  # "... there was a little robot / a small town / a girl ..."
    assert texts[1].startswith(" Paris"), texts
    assert stats.num_accepted_drafts > 0 and stats.mean_tokens_per_step > 1.1, stats


def test_first_use_training_says_what_it_does_and_shows_progress(tmp_path, monkeypatch, capfd):
    """Making the tiny model (a shortened recipe here, so a cache of its own) prints one line that
    says what runs and that it runs once, then a progress bar of the training steps; the next
    call finds the model and prints nothing."""
    from tpspec.model import tiny

    monkeypatch.setenv("TPSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(tiny, "TRAIN_STEPS", 3)
    path = tiny_model_path()
    err = capfd.readouterr().err
    assert path.startswith(str(tmp_path))
    assert f"tpspec: training the tiny model once, on first use (3 small steps on the CPU); later runs load it from " \
           f"{path}" in err
    assert "training the tiny model: 100%" in err and "3/3" in err
    assert tiny_model_path() == path and capfd.readouterr().err == ""
