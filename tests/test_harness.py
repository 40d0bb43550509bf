"""subquad in lm-evaluation-harness: on a tiny transformers checkpoint, local tasks (YAML and JSON written
here) score the same under ``--model subquad`` as under lm_eval's own ``hf`` backend, and a choice question's
context is read once for all its choices."""

from __future__ import annotations

import json
import os

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")              # the `eval` extra installs it (make test requires it)
transformers = pytest.importorskip("transformers")

from subquad.harness import SubquadLM  # noqa: E402
from tests.models.test_hf import _hf_mamba  # noqa: E402
from tests.models.test_hf_user_path import _tokenizer_files  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _tasks(tmp_path):
    """Three local tasks over words w00..w63: 4-way choices, a rolling loglikelihood, greedy generation."""
    g = torch.Generator().manual_seed(3)

    def words(n):
        return " ".join(f"w{i:02d}" for i in torch.randint(2, 64, (n,), generator=g).tolist())

    docs = [{"question": words(int(torch.randint(3, 12, (1,), generator=g))) + " ?",
             "choices": [words(k) for k in (1, 2, 3, 2)], "answer": int(torch.randint(0, 4, (1,), generator=g)),
             "text": words(30)} for _ in range(12)]
    data = tmp_path / "data.json"
    data.write_text("\n".join(json.dumps(d) for d in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text("task: sq_mc\n" + common + "output_type: multiple_choice\n"
                                   "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                                   "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (tasks / "roll.yaml").write_text("task: sq_roll\n" + common + "output_type: loglikelihood_rolling\n"
                                     "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                                     "metric_list:\n  - metric: word_perplexity\n")
    (tasks / "gen.yaml").write_text("task: sq_gen\n" + common + "output_type: generate_until\n"
                                    "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[0]}}'\n"
                                    "generation_kwargs:\n  until: ['w07']\n  max_gen_toks: 6\n  do_sample: false\n"
                                    "metric_list:\n  - metric: exact_match\n")
    return tasks


def _run(model, tasks, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model=model, tasks=["sq_mc", "sq_roll", "sq_gen"], task_manager=TaskManager(
        include_path=str(tasks), include_defaults=False), log_samples=True, **kw)
    return res


def test_scores_equal_the_hf_backend_and_contexts_are_read_once(tmp_path):
    hf, folder = _hf_mamba(tmp_path, falcon="mamba2")
    _tokenizer_files(folder, eos=5)
    tasks = _tasks(tmp_path)
    theirs = _run("hf", tasks, model_args=f"pretrained={folder},dtype=float32", device="cpu", batch_size=4)
    ours_lm = SubquadLM(path=str(folder), batch_size=4)
    ours = _run(ours_lm, tasks)

    for task in ("sq_mc", "sq_roll", "sq_gen"):
        a, b = (sorted(r["samples"][task], key=lambda d: d["doc_id"]) for r in (theirs, ours))
        assert len(a) == len(b) == 12
        for x, y in zip(a, b, strict=True):
            assert x["doc_id"] == y["doc_id"] and len(x["resps"]) == len(y["resps"]) > 0
            for ra, rb in zip(x["resps"], y["resps"], strict=True):
                if task == "sq_gen":
                    assert ra == rb
                else:
                    got, want = rb[0], ra[0]
                    if task == "sq_mc":                            # (loglikelihood, is_greedy)
                        assert bool(got[1]) == bool(want[1]), (task, got, want)
                        got, want = got[0], want[0]
                    assert abs(float(got) - float(want)) <= 1e-4 * max(1.0, abs(float(want))), (task, got, want)
    assert ours["results"]["sq_mc"]["acc,none"] == theirs["results"]["sq_mc"]["acc,none"]
    assert ours_lm.context_prefills == 12                 # 12 questions, 48 choices: each question read once


def _pair(encode, context, continuation):
    """lm_eval's rule for a causal model, written out here (not SubquadLM's ``_pair``): trailing whitespace of
    the context goes to the continuation; the continuation's tokens are those context + continuation adds."""
    assert context
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    assert whole[:len(ctx)] == ctx
    return ctx, whole[len(ctx):]


def test_a_subquad_run_and_the_cli(tmp_path, capsys, corpus):
    """A run trained here: each choice's loglikelihood and greedy flag equal those of one plain full forward
    over context + choice of the run loaded separately in the test (no state reused, no packing, not
    SubquadLM's tokenisation), and `subquad eval --run RUN --tasks` prints the task's table."""
    from lm_eval.api.instance import Instance

    from subquad.cli import main
    from subquad.train.run import load_run

    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "2", "--context", "32", "--pattern", "gla,softmax", "--steps", "2", "--batch-size", "2",
                 "--out", str(run), "--no-progress"]) == 0
    model, tok, _ = load_run(run)                            # the test's own copy of the run, beside SubquadLM's

    def encode(s):
        return tok.encode(s, add_special_tokens=False).ids

    def greedy_text(context, n):                             # n greedy tokens after context, as text
        ids = encode(context)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return tok.decode(ids)[len(tok.decode(encode(context))):]

    pairs = [(q, c) for q in ("def main(", "import os\n", "x = ") for c in (" return", "self)", "\n", " 1")]
    pairs += [("def main(", greedy_text("def main(", 2)), ("x =", greedy_text("x =", 3))]   # greedy choices too
    lm = SubquadLM(path=str(run), batch_size=3)
    reqs = [Instance("loglikelihood", {}, pair, 0) for pair in pairs]
    got = lm.loglikelihood(reqs)
    assert lm.context_prefills == 3 and len(got) == len(reqs)     # "x = " and "x =" are one context: "x ="
    greedy_seen = set()
    with torch.no_grad():
        for (context, continuation), (ll, greedy) in zip(pairs, got, strict=True):
            ctx, cont = _pair(encode, context, continuation)
            assert cont
            logits = model(torch.tensor([ctx + cont]))[0].double()
            pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)    # where each continuation token is predicted
            target = torch.tensor(cont)
            want = torch.log_softmax(logits, -1)[pos, target].sum().item()
            want_greedy = bool((logits[pos].argmax(-1) == target).all())
            assert abs(ll - want) <= 1e-4 * max(1.0, abs(want)), (context, continuation, ll, want)
            assert greedy is want_greedy, (context, continuation, greedy)
            greedy_seen.add(want_greedy)
    assert greedy_seen == {True, False}                      # both answers of the greedy flag were checked
    tasks = _tasks(tmp_path)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--tasks", "sq_mc", "--include-path", str(tasks), "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "sq_mc" in out and "acc" in out and "contexts read: 4" in out
    assert main(["eval", "--run", str(run), "--tasks", "sq_mc,nosuch_task", "--include-path", str(tasks)]) == 2
    assert "--tasks nosuch_task: no such lm-evaluation-harness task" in capsys.readouterr().err

    from subquad.harness import main as harness_main              # lm_eval's own command line, --model subquad

    harness_main(["--model", "subquad", "--model_args", f"path={run},batch_size=2", "--tasks", "sq_mc",
                  "--include_path", str(tasks), "--limit", "2"])
    out = capsys.readouterr().out
    assert "sq_mc" in out and "acc" in out
