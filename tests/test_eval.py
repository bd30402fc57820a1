"""Perplexity (`ember.eval`, `ember eval`) against transformers' loss on the same tokens and windows."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from ember.cli.main import main
from ember.eval import perplexity, windows
from tests.conftest import load_hf_dir


def transformers_perplexity(model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """Strided perplexity as Hugging Face's guide computes it: each window's tokens before the previous
    window's end are labelled -100, and transformers' loss (its own shift) averages the rest."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        x = torch.tensor([ids[begin:end]])
        labels = x.clone()
        labels[:, : prev_end - begin] = -100
        with torch.no_grad():
            loss = model(x, labels=labels).loss
        scored = int((labels[:, 1:] != -100).sum())
        total, count, prev_end = total + loss.item() * scored, count + scored, end
        if end == len(ids):
            break
    return math.exp(total / count), count


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("window, stride", [(300, 150), (64, 32), (50, 49), (40, 7), (2, 1)])
def test_perplexity_matches_transformers_in_any_windows(tiny_llama_dir, hf_model, window, stride):
    ids = torch.randint(0, 49152, (217,)).tolist()
    ours = perplexity(load_hf_dir(tiny_llama_dir), ids, window=window, stride=stride)
    expected, scored = transformers_perplexity(hf_model, ids, min(window, len(ids)), stride)
    assert ours.scored == scored == len(ids) - 1
    assert ours.windows == len(windows(len(ids), min(window, len(ids)), stride))
    assert ours.perplexity == pytest.approx(expected, rel=1e-5)
    # A random model over 49152 tokens: near-uniform predictions, so the value itself is a check of the scale.
    assert 0.5 * 49152 < ours.perplexity < 2 * 49152


def test_windows_score_every_token_but_the_first_once_with_its_context():
    for count, window, stride in [(10, 4, 1), (10, 4, 3), (100, 16, 8), (17, 17, 5), (5, 9, 2), (33, 8, 7)]:
        spans = windows(count, window, stride)
        scored = [t for _, end, first in spans for t in range(first, end)]
        assert scored == list(range(1, count)), (count, window, stride)
        for begin, end, first in spans:
            assert end - begin <= window and begin < first
            assert first - begin >= min(window - stride, first)  # each scored token sees that many before it
    for window, stride in [(4, 4), (4, 0), (1, 1)]:
        with pytest.raises(ValueError, match="expected window >= 2"):
            windows(10, window, stride)


def test_eval_cli_scores_a_text_file_as_transformers_does(tiny_llama_dir, hf_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    text = "Perplexity is the exponential of the mean negative log-likelihood. " * 12
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    args = ["eval", str(tiny_llama_dir), "--text", str(path), "--window", "48", "--stride", "20", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(text)["input_ids"]
    expected, scored = transformers_perplexity(hf_model, ids, 48, 20)
    assert (r["tokens"], r["scored"], r["window"], r["stride"]) == (len(ids), scored, 48, 20)
    assert r["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert r["nll"] == pytest.approx(math.log(expected), rel=1e-5)
    assert (r["quantize"], r["device"], r["dtype"], r["text"]) == ("none", "cpu", "float32", str(path))

    assert main(["eval", str(tiny_llama_dir), "--text", str(path), "--window", "48", "--stride", "20"]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"perplexity  ([0-9.]+) ", out)[1]) == pytest.approx(expected, rel=1e-5)
    assert f"{len(ids)} ({scored} scored in {r['windows']} windows of <= 48, 20 apart)" in out


def test_eval_of_a_quantized_model_costs_what_the_scheme_costs(tiny_llama_dir, capsys):
    """int8 weights move a tiny random model's perplexity by well under 1% (its near-uniform predictions), and
    the run says which scheme it measured."""
    assert main(["eval", str(tiny_llama_dir), "--json", "--no-quant-cache"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(["eval", str(tiny_llama_dir), "--json", "--quantize", "int8", "--no-quant-cache"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert (base["quantize"], q["quantize"], q["tokens"]) == ("none", "int8", base["tokens"])
    assert q["perplexity"] != base["perplexity"]
    assert q["perplexity"] == pytest.approx(base["perplexity"], rel=5e-3)


@pytest.mark.parametrize(
    "extra, content, message",
    [
        (["--text", "{tmp}/missing.txt"], None, "--text {tmp}/missing.txt: no such file"),
        (["--text", "{tmp}"], None, "is a directory; expected a UTF-8 text file"),
        (["--text", "{tmp}/bad.txt"], b"caf\xe9 au lait", "byte 0xe9 at offset 3 is not UTF-8"),
        (["--text", "{tmp}/one.txt"], b"a", "is 1 token(s) long; perplexity needs at least 2"),
        (["--window", "600"], None, "--window 600 is longer than the context of 512 tokens"),
        (["--window", "100", "--max-seq-len", "64"], None, "context of 64 tokens (set by --max-seq-len)"),
        (["--window", "32", "--stride", "32"], None, "--stride 32 is not shorter than the window of 32"),
    ],
)
def test_eval_refuses_bad_input_naming_it(tiny_llama_dir, tmp_path, capsys, extra, content, message):
    if content is not None:
        (tmp_path / extra[1].removeprefix("{tmp}/")).write_bytes(content)
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    assert main(["eval", str(tiny_llama_dir), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.replace("{tmp}", str(tmp_path)) in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_eval_of_the_default_model_is_transformers_perplexity_of_the_file(smollm2_gguf, capsys):
    """The default load (the GGUF's own codes on a CPU) against transformers' float32 model of the same file,
    on the built-in passage: within the int16 activation codes' rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ember.quant import QUALITY_TEXT

    assert main(["eval", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ids = tokenizer(QUALITY_TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    expected, scored = transformers_perplexity(model, ids, len(ids), len(ids))
    assert (r["model"], r["quantize"], r["text"]) == (
        "smollm2-135m-instruct",
        "the file's codes",
        "the built-in passage",
    )
    assert (r["tokens"], r["scored"], r["windows"]) == (len(ids), scored, 1)
    assert r["perplexity"] == pytest.approx(expected, rel=1e-3)


def test_compare_is_transformers_divergence_between_two_models(
    tiny_llama_dir, hf_model, smollm2_tokenizer_dir, tmp_path
):
    """Two different models (the tiny Llama, and it with its weights moved by noise): each side's perplexity,
    the mean and 99th-percentile KL divergence and the top-token agreement, against the same quantities from
    transformers' logits of both over the same windows."""
    from transformers import AutoModelForCausalLM

    from ember.eval import compare
    from tests.conftest import save_tiny

    other = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    other_dir = save_tiny(other, tmp_path / "other", smollm2_tokenizer_dir)
    ids = torch.randint(0, 49152, (150,)).tolist()
    ours, theirs, divergence = compare(
        load_hf_dir(other_dir), load_hf_dir(tiny_llama_dir), ids, window=64, stride=24
    )
    assert ours.perplexity == pytest.approx(transformers_perplexity(other, ids, 64, 24)[0], rel=1e-5)
    assert theirs.perplexity == pytest.approx(transformers_perplexity(hf_model, ids, 64, 24)[0], rel=1e-5)

    kl, same = [], 0
    for begin, end, first in windows(len(ids), 64, 24):
        x = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            p = torch.log_softmax(hf_model(x).logits[0, first - 1 - begin : end - 1 - begin], -1)
            q = torch.log_softmax(other(x).logits[0, first - 1 - begin : end - 1 - begin], -1)
        kl.append(torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1))
        same += int((p.argmax(-1) == q.argmax(-1)).sum())
    kl = torch.cat(kl).double()
    assert kl.numel() == len(ids) - 1
    assert divergence.kl_divergence == pytest.approx(float(kl.mean()), rel=1e-4)
    assert divergence.kl_divergence_p99 == pytest.approx(float(kl.quantile(0.99)), rel=1e-4)
    assert divergence.top_agreement == same / (len(ids) - 1)
    assert 0 < divergence.top_agreement < 1 and divergence.kl_divergence > 1e-3


def test_eval_versus_reports_both_runs_on_the_same_windows(tiny_llama_dir, capsys):
    base = ["eval", str(tiny_llama_dir), "--json", "--no-quant-cache", "--window", "64", "--stride", "32"]
    assert main([*base, "--quantize", "int8", "--versus", "none"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert main(base) == 0
    float_run = json.loads(capsys.readouterr().out)
    assert main([*base, "--quantize", "int8"]) == 0
    int8_run = json.loads(capsys.readouterr().out)
    assert (r["quantize"], r["versus"]["quantize"]) == ("int8", "none")
    assert r["perplexity"] == int8_run["perplexity"] and r["versus"]["perplexity"] == float_run["perplexity"]
    v = r["versus"]
    assert 0 < v["kl_divergence"] < v["kl_divergence_p99"] < 0.05 and 0.5 < v["top_agreement"] <= 1

    assert main([*base, "--versus", "none"]) == 0  # the same weights: no divergence at all
    same = json.loads(capsys.readouterr().out)["versus"]
    assert (same["kl_divergence"], same["kl_divergence_p99"], same["top_agreement"]) == (0, 0, 1)

    assert (
        main(["eval", str(tiny_llama_dir), "--quantize", "int8", "--versus", "none", "--no-quant-cache"]) == 0
    )
    out = capsys.readouterr().out
    assert "  versus      none: perplexity " in out and "the same most likely token at " in out
