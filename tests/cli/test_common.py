"""The pieces the commands share (subquad.cli.common) and --stop's text handling (subquad.cli.generate)."""

import argparse

import pytest
import torch

from subquad.cli import build_parser, common
from subquad.cli.generate import StopText, stop_texts, unescape


@pytest.mark.parametrize("text, want", [("é", "é"), ("日本", "日本"), ("\\n", "\n"), ("a\\tb", "a\tb"),
                                        ("</s>", "</s>"), ("ü\\n", "ü\n")])
def test_stop_text_keeps_non_ascii_and_reads_backslash_escapes(text, want):
    # the old `text.encode().decode("unicode_escape")` read UTF-8 bytes as Latin-1: "é" -> "Ã©"
    assert unescape(text) == want
    assert stop_texts([text, "x"]) == [want, "x"]


def test_an_empty_stop_text_is_refused_by_name():
    with pytest.raises(ValueError, match="--stop: an empty text"):
        stop_texts(["a", ""])


def test_a_stop_text_across_tokens_ends_the_text_before_it():
    """Tokens "ab", "c\n", "de", "f" with stop "\nd" (across two tokens): "ab" released at once, "c" next (its
    "\n" held back), nothing after "abc" (the server's TextStream); a stop never reached releases everything
    at the end."""
    pieces = ["ab", "c\n", "de", "f"]
    tok = type("Tok", (), {"decode": staticmethod(lambda ids: "".join(pieces[i] for i in ids))})()
    text = StopText(tok, ["\nd"])
    assert text.push(0) == ("ab", False)
    assert text.push(1) == ("c", False)                  # "\n" may begin the stop text: held back
    assert text.push(2) == ("", True) and text.stream.text == "abc" and text.rest() == ""
    text = StopText(tok, ["zz"])
    assert [text.push(i)[1] for i in range(4)] == [False] * 4
    assert text.stream.text + text.rest() == "abc\ndef"


def test_run_and_model_are_checked_once_for_every_command_that_loads_a_model(tmp_path):
    p = build_parser()
    for cmd in ("generate", "eval", "serve"):
        with pytest.raises(ValueError, match="give one of --run"):
            common.check_run_or_model(p.parse_args([cmd]))
        with pytest.raises(ValueError, match="give one of --run"):
            common.check_run_or_model(p.parse_args([cmd, "--run", str(tmp_path), "--model", str(tmp_path)]))
        with pytest.raises(ValueError, match="does-not-exist does not exist"):
            common.check_run_or_model(p.parse_args([cmd, "--run", str(tmp_path / "does-not-exist")]))
    (tmp_path / "run" / "ckpt").mkdir(parents=True)                     # a run and a model folder, swapped
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "mamba2"}')
    for cmd in ("generate", "eval", "serve"):
        with pytest.raises(ValueError, match="is a training run .*: give it as --run"):
            common.check_run_or_model(p.parse_args([cmd, "--model", str(tmp_path / "run")]))
        if cmd != "serve":
            with pytest.raises(ValueError, match="is a model folder, not a training run: give it as --model"):
                common.check_run_or_model(p.parse_args([cmd, "--run", str(tmp_path / "hf")]))


def test_device_is_resolved_by_argparse_and_dtype_names_a_torch_dtype():
    p = build_parser()
    for cmd in ("generate", "eval", "serve", "train", "recall"):
        assert p.parse_args([cmd, "--device", "cpu"]).device == torch.device("cpu")
    for name in common.DTYPES:
        assert isinstance(getattr(torch, name), torch.dtype)
    with pytest.raises(argparse.ArgumentTypeError, match="device must be one of"):
        common.device("tpu")


def test_every_command_is_a_module_with_add_parser_and_run():
    import importlib

    p = build_parser()
    commands = p._subparsers._group_actions[0].choices
    assert set(commands) == {"memory", "workshop", "train", "compare", "recall", "eval", "export", "generate", "serve"}
    for name, sub in commands.items():
        mod = importlib.import_module(f"subquad.cli.{name}")
        assert sub.get_default("fn") is mod.run, name


def test_generate_takes_the_servers_sampling_options(tmp_path, capsys):
    """``subquad generate``'s --min-p, penalties, --logit-bias, --stop-token-id and --ignore-eos: the text of
    ``model.generate`` with the same options; a bad one is refused by its flag before the model loads."""
    from subquad.cli import main
    from tests.serve.helpers import folder, load

    path = folder(tmp_path / "m", "mamba2", eos=46)
    model, tok = load(path)
    ids = tok.encode("w5 w6").ids
    opts = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 3.0}, min_p=0.1,
                ignore_eos=True)
    free = model.generate(ids, 8, temperature=0, **opts)[0]
    want = model.generate(ids, 8, temperature=0, stop_ids=[free[5]], **opts)[0]
    assert want != model.generate(ids, 8, temperature=0)[0] and len(want) > 1
    argv = ["generate", "--model", str(path), "--prompt", "w5 w6", "--max-new-tokens", "8", "--temperature", "0",
            "--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
            "--logit-bias", "7=3", "--min-p", "0.1", "--ignore-eos", "--stop-token-id", str(free[5])]
    assert main(argv) == 0                                # the stop token's own text left out, as the server's
    assert want[-1] == free[5] and capsys.readouterr().out == "w5 w6" + tok.decode(want[:-1]) + "\n"
    for flag, value in (("--min-p", "2"), ("--repetition-penalty", "0"), ("--logit-bias", "7"),
                        ("--logit-bias", "7=500"), ("--stop-token-id", "-3")):
        assert main(argv[:5] + [flag, value]) == 2
        assert flag in capsys.readouterr().err


def test_ctrl_c_ends_a_command_in_one_line_with_the_way_to_resume(monkeypatch, capsys, tmp_path):
    import subquad.cli.train as train
    from subquad.cli import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    assert main(["train", "--out", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err
    assert err.strip() == f"interrupted; continue with: subquad train --resume --out {tmp_path / 'r'}"


def test_sigterm_ends_training_in_one_line_and_the_callers_handler_comes_back(monkeypatch, capsys, tmp_path):
    import os
    import signal
    import time

    import subquad.cli.train as train
    from subquad.cli import main

    def killed(args):                      # a scheduler's stop arriving mid-run
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(train, "run", killed)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", "--out", str(tmp_path / "r")]) == 143
    err = capsys.readouterr().err.strip()
    assert err == f"terminated; continue with: subquad train --resume --out {tmp_path / 'r'}"
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_output_path_that_is_a_file_is_one_line(tmp_path, capsys):
    from subquad.cli import main

    (tmp_path / "one.txt").write_text("x")
    assert main(["workshop", "--no-train", "--out", str(tmp_path / "one.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'one.txt'}") and len(err.strip().splitlines()) == 1



def test_lengths_in_tokens_read_as_people_write_them():
    from subquad.cli.common import token_count
    from subquad.cli.memory import contexts

    assert [token_count(t) for t in ("512", "4K", "4k", "1M", "16_384", "1e4", " 2K ")] == \
        [512, 4096, 4096, 1048576, 16384, 10000, 2048]
    for bad in ("0", "-4K", "1.5", "x", "K", "", "inf", "nan"):
        with pytest.raises(ValueError, match="length in tokens"):
            token_count(bad)
    assert contexts("1K,4K,1M") == [1024, 4096, 1048576]
    with pytest.raises(argparse.ArgumentTypeError, match="--context takes .*got '0.3K'"):
        contexts("1K,0.3K")


def test_an_eval_flag_its_mode_would_not_read_is_refused_by_name():
    from subquad.cli.eval import _check_flags_of_mode

    def check(argv):
        _check_flags_of_mode(build_parser().parse_args(["eval", *argv]))

    check(["--run", "r", "--batches", "2"])                   # each mode's own flags pass
    check(["--model", "m", "--data", "t.txt", "--piece", "256"])
    check(["--model", "m", "--passkey", "--piece", "256", "--lengths", "1K", "--out", "o"])
    check(["--run", "r", "--tasks", "x", "--limit", "3", "--batch-size", "4"])
    check(["--run", "r", "--piece", "1024"])                  # a default written out changes nothing either
    for argv, flag, where in ((["--run", "r", "--piece", "256"], "--piece", "not to --run's held-out loss"),
                              (["--model", "m", "--tasks", "x", "--data", "t"], "--data", "not to --tasks"),
                              (["--model", "m", "--lengths", "4K"], "--lengths", "not to --model's perplexity"),
                              (["--run", "r", "--passkey", "--batches", "3"], "--batches", "not to --passkey")):
        with pytest.raises(ValueError, match=f"^{flag} applies to .*{where}"):
            check(argv)


def test_subquads_own_warnings_print_as_one_line_on_the_command_line():
    import warnings

    import subquad.models.quant as quant
    from subquad.cli import _one_line

    ours = _one_line(warnings.formatwarning, UserWarning("int4 ..."), UserWarning, quant.__file__, 703)
    assert ours == "warning: int4 ...\n"
    for category, path in ((FutureWarning, quant.__file__), (UserWarning, "/x/subquad/.venv/torch/nn/x.py")):
        assert _one_line(warnings.formatwarning, category("old"), category, path, 9) == \
            warnings.formatwarning(category("old"), category, path, 9)           # not ours: as it was


def test_generate_stops_where_the_server_does_when_a_folder_names_no_end_of_text(tmp_path, capsys, monkeypatch):
    """A folder naming no end-of-text id (as a subquad run's): ``subquad generate`` stops at its tokenizer's
    ``<|endoftext|>`` as ``subquad serve`` does (``data.tokenizer.end_of_text_ids``); --ignore-eos goes on."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from subquad.cli import main
    from subquad.models import LanguageModel
    from tests.serve.helpers import V, folder

    path = folder(tmp_path / "m", "mamba2")
    vocab = {("<|endoftext|>" if i == 9 else f"w{i}"): i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w10"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    seen, generate = [], LanguageModel.generate
    monkeypatch.setattr(LanguageModel, "generate", lambda self, *a, **k: seen.append(k) or generate(self, *a, **k))
    argv = ["generate", "--model", str(path), "--prompt", "w5 w6", "--max-new-tokens", "6", "--temperature", "0",
            "--logit-bias", "9=50"]                                        # <|endoftext|> the first pick
    assert main(argv) == 0 and capsys.readouterr().out == "w5 w6\n"
    assert 9 in seen[-1]["stop_ids"]
    assert main(argv + ["--ignore-eos"]) == 0 and 9 not in seen[-1]["stop_ids"]
