"""`long/needle-v0`: answer a question from a generated corpus through `search` and `read` tools.

The corpus (`corpus_tokens` words, default 20K; 1M works) is made from the seed: documents of
`doc_words` pseudo-words, a few of them holding sentences "The vault NAME opens with code NNNN."
for different vaults. The question asks for one vault's code. Tools: `search(query)` (document ids
whose text contains the query, case-insensitive, with a snippet; at most 5), `read(doc_id, page)`
(a page of 100 words), `submit(answer)`.

Milestones (sparse): `found` (0.25) when a page holding the asked vault's sentence is read;
`solved` (1.0) when the right code is submitted. No sandbox: the tools run no model-written code.
"""

from __future__ import annotations

import numpy as np

from envs.base import ToolEnv, ToolFailure, ToolSpec
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tu",
    "sa",
    "vo",
    "ne",
    "qui",
    "dar",
    "pel",
    "zo",
    "an",
    "tri",
    "mu",
    "es",
]
_NAMES = [
    "Amber",
    "Basalt",
    "Cobalt",
    "Dune",
    "Ember",
    "Fjord",
    "Garnet",
    "Harbor",
    "Indigo",
    "Juniper",
    "Krypton",
    "Lagoon",
    "Marble",
    "Nimbus",
    "Onyx",
    "Pewter",
    "Quartz",
    "Russet",
    "Sable",
    "Tundra",
]
PAGE_WORDS = 100


def _vocabulary(n: int = 2000) -> np.ndarray:
    rng = np.random.default_rng(12345)  # the same vocabulary for every seed
    words = {"".join(rng.choice(_SYLLABLES, size=int(rng.integers(2, 4)))) for _ in range(n * 2)}
    return np.array(sorted(words)[:n])


class NeedleEnv(ToolEnv):
    tools = [
        ToolSpec(
            "search",
            "Find documents containing a phrase (case-insensitive); returns up to 5 ids with snippets.",
            {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        ),
        ToolSpec(
            "read",
            "Read one page (100 words) of a document.",
            {
                "type": "object",
                "properties": {"doc_id": {"type": "integer"}, "page": {"type": "integer"}},
                "required": ["doc_id"],
            },
        ),
        ToolSpec(
            "submit",
            "Submit the answer; ends the episode.",
            {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        ),
    ]

    milestones = (
        Milestone("found", 0.25, "read a page holding the asked vault's sentence"),
        Milestone("solved", 1.0, "submitted the right code"),
    )

    def __init__(
        self, corpus_tokens: int = 20_000, doc_words: int = 400, vaults: int = 6, max_turns: int = 8
    ):
        super().__init__()
        if corpus_tokens < doc_words or vaults < 1 or vaults > len(_NAMES):
            raise ValueError("need corpus_tokens >= doc_words and 1 <= vaults <= 20")
        self.corpus_tokens, self.doc_words, self.vaults, self.max_turns = (
            corpus_tokens,
            doc_words,
            vaults,
            max_turns,
        )
        self.vocab = _vocabulary()

    def _reset_task(self) -> str:
        rng = self.np_random
        n_docs = self.corpus_tokens // self.doc_words
        words = self.vocab[rng.integers(len(self.vocab), size=(n_docs, self.doc_words))]
        docs = [list(row) for row in words]
        names = [_NAMES[i] for i in rng.choice(len(_NAMES), size=self.vaults, replace=False)]
        self.codes = {name: f"{int(rng.integers(1000, 10000))}" for name in names}
        self.places = {}
        for name in names:
            d, w = int(rng.integers(n_docs)), int(rng.integers(self.doc_words))
            sentence = f"The vault {name} opens with code {self.codes[name]}.".split()
            docs[d][w:w] = sentence
            self.places[name] = (d, w)
        self.docs = [" ".join(doc) for doc in docs]
        self.lower = [doc.lower() for doc in self.docs]
        self.asked = names[int(rng.integers(len(names)))]
        d, w = self.places[self.asked]
        self.needle_page = (d, w // PAGE_WORDS)
        # a sentence cut by a page break is on two pages: reading either counts as finding it
        self.needle_pages = {(d, w // PAGE_WORDS), (d, (w + 6) // PAGE_WORDS)}
        return (
            f"A corpus of {n_docs} documents ({self.corpus_tokens:,} words) is searchable. "
            f"What code opens the vault {self.asked}? Search, read, then submit the code."
        )

    def tool_functions(self):
        return {"search": self._search, "read": self._read, "submit": self._submit}

    def _search(self, query: str) -> str:
        q = str(query).lower().strip()
        if len(q) < 3:
            raise ToolFailure("query must have at least 3 characters")
        hits = []
        for i, text in enumerate(self.lower):
            at = text.find(q)
            if at >= 0:
                hits.append(
                    f"doc {i}, page {text.count(' ', 0, at) // PAGE_WORDS}: ...{self.docs[i][max(0, at - 40) : at + 60]}..."
                )
                if len(hits) == 5:
                    break
        return "\n".join(hits) if hits else "no document contains that"

    def _read(self, doc_id, page=0) -> str:
        try:
            doc_id, page = int(doc_id), int(page)
        except (TypeError, ValueError):
            raise ToolFailure("doc_id and page must be integers") from None
        if not 0 <= doc_id < len(self.docs):
            raise ToolFailure(f"doc_id must be in [0, {len(self.docs) - 1}]")
        words = self.docs[doc_id].split(" ")
        n_pages = (len(words) + PAGE_WORDS - 1) // PAGE_WORDS
        if not 0 <= page < n_pages:
            raise ToolFailure(f"document {doc_id} has pages 0..{n_pages - 1}")
        if (doc_id, page) in self.needle_pages:
            self.reach("found", 0.25, self._events)
        return f"doc {doc_id} page {page}/{n_pages - 1}: " + " ".join(
            words[page * PAGE_WORDS : (page + 1) * PAGE_WORDS]
        )

    def _submit(self, answer) -> str:
        self.finish()
        if str(answer).strip().rstrip(".") == self.codes[self.asked]:
            self.reach("solved", 1.0, self._events)
            return "correct"
        return "incorrect"

    def expert_turns(self) -> list[str]:
        d, page = self.needle_page
        return [
            call("search", query=f"vault {self.asked} opens"),
            call("read", doc_id=d, page=page),
            call("submit", answer=self.codes[self.asked]),
        ]
