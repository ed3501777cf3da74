"""SynthHop: a seeded fictional world whose 1-, 2- and 3-hop questions need chained searches.

People, companies, cities and countries are linked by relations (a person is born in a city and married to
another person; a company is founded by a person and based in a city; a city lies in a country). Each
entity gets one short encyclopedia-style passage. A k-hop question names only its first entity: the bridge
entities are found in the passages, one search at a time, e.g.

    In which country was the founder of Brightwater Guild born?
    search "Brightwater Guild" -> founded by Varno Keld; search "Varno Keld" -> born in Quellmoor;
    search "Quellmoor" -> a city in Dravia  => Dravia

Names overlap on purpose (people share first and last names, companies and cities share words), so a vague
query retrieves the wrong passage. The world is written in the formats the real loaders read (corpus
``wiki/paragraphs.jsonl``, questions ``synthhop/{train,dev}.json`` as HotpotQA JSON whose supporting facts
list the gold query of each hop in order), so ``SearchQAEnv``, the retrievers and the rewards serve it with
no special code path. Train and dev questions never share a (template, subject) pair.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.retrieval.corpus import default_cache_dir

SYLLABLES = ("ka", "ren", "vo", "mi", "tal", "dor", "sa", "lin", "bra", "nu", "kel", "ta", "vi", "mor", "el",
             "an", "is", "ga", "ru", "fen", "lo", "quin", "ze", "har", "to", "wyn", "bel", "cor", "da", "ith")
COMPANY_WORDS = ("Guild", "Works", "Mills", "Foundry", "Trading", "Press", "Shipping", "Labs", "Brewery", "Bank")
COMPANY_KINDS = ("guild", "manufacturer", "mill", "foundry", "trading house", "publisher", "shipping firm",
                 "laboratory", "brewery", "bank")
OCCUPATIONS = ("painter", "engineer", "sailor", "physician", "merchant", "poet", "architect", "botanist")

# (subject type, relation path, question template) -> the answer is the end of the path
TEMPLATES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("person", ("born_in",), "In which city was {} born?"),
    ("person", ("spouse",), "Who is {} married to?"),
    ("company", ("founder",), "Who founded {}?"),
    ("company", ("based_in",), "In which city is {} based?"),
    ("city", ("country",), "In which country is the city of {}?"),
    ("company", ("founder", "born_in"), "In which city was the founder of {} born?"),
    ("person", ("spouse", "born_in"), "In which city was the spouse of {} born?"),
    ("company", ("based_in", "country"), "In which country is the company {} based?"),
    ("person", ("born_in", "country"), "In which country was {} born?"),
    ("company", ("founder", "spouse"), "Who is the spouse of the founder of {}?"),
    ("company", ("founder", "born_in", "country"), "In which country was the founder of {} born?"),
    ("person", ("spouse", "born_in", "country"), "In which country was the spouse of {} born?"),
)


@dataclass(frozen=True)
class WorldSpec:
    """Sizes and seed of a world. ``hop_mix``: the shares of 1-, 2- and 3-hop questions."""

    seed: int = 0
    people: int = 200
    companies: int = 100
    cities: int = 40
    countries: int = 12
    train_questions: int = 800
    dev_questions: int = 150
    hop_mix: tuple[float, float, float] = (0.3, 0.4, 0.3)

    def __post_init__(self) -> None:
        if self.people < 2 or self.people % 2:
            raise ValueError(f"people must be an even number >= 2 (they marry in pairs), got {self.people}")
        for name in ("companies", "cities", "countries", "train_questions", "dev_questions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.hop_mix) != 3 or min(self.hop_mix) < 0 or not np.isclose(sum(self.hop_mix), 1.0):
            raise ValueError(f"hop_mix must be three shares summing to 1, got {self.hop_mix}")

    @property
    def key(self) -> str:
        """A short hash naming this world's files in the cache."""
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Entity:
    name: str
    kind: str  # person, company, city, country
    facts: dict[str, str] = field(default_factory=dict)  # relation -> entity name
    detail: str = ""  # occupation / company kind / founding year: flavour text


@dataclass(frozen=True)
class SynthQuestion:
    question: str
    answer: str
    chain: tuple[str, ...]  # the entity searched at each hop, in order (its passage holds the next link)

    @property
    def hops(self) -> int:
        return len(self.chain)


class World:
    """The entities of a ``WorldSpec``, their passages and every question the templates can ask."""

    def __init__(self, spec: WorldSpec):
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        countries = _unique_names(rng, spec.countries, lambda: _word(rng, 2, 3))
        cities = _unique_names(rng, spec.cities, lambda: _place(rng))
        people = _unique_names(rng, spec.people, lambda: None, pool=_person_names(rng, spec.people))
        companies = _unique_names(rng, spec.companies, lambda: f"{_word(rng, 2, 3)} {rng.choice(COMPANY_WORDS)}")
        self.entities: dict[str, Entity] = {}
        for name in countries:
            self.entities[name] = Entity(name, "country")
        for name in cities:
            self.entities[name] = Entity(name, "city", {"country": str(rng.choice(countries))})
        order = rng.permutation(len(people))
        spouse = {}
        for a, b in zip(order[0::2], order[1::2], strict=True):
            spouse[people[a]], spouse[people[b]] = people[b], people[a]
        for name in people:
            self.entities[name] = Entity(name, "person", {"born_in": str(rng.choice(cities)), "spouse": spouse[name]},
                                         str(rng.choice(OCCUPATIONS)))
        for name in companies:
            kind = COMPANY_KINDS[COMPANY_WORDS.index(name.split()[-1])]
            self.entities[name] = Entity(name, "company", {"founder": str(rng.choice(people)),
                                                           "based_in": str(rng.choice(cities))},
                                         f"{kind}, founded in {int(rng.integers(1820, 1990))}")

    def passage(self, name: str) -> str:
        """The encyclopedia-style text of one entity (its title is the name)."""
        e = self.entities[name]
        if e.kind == "person":
            return (f"{name} is a {e.detail} who was born in {e.facts['born_in']}. {name} is married to "
                    f"{e.facts['spouse']}.")
        if e.kind == "company":
            kind, year = e.detail.split(", ")
            return f"{name} is a {kind} based in {e.facts['based_in']}. It was {year} by {e.facts['founder']}."
        if e.kind == "city":
            return f"{name} is a city in {e.facts['country']}."
        return f"{name} is a country."

    def answer(self, subject: str, path: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """The end of ``path`` from ``subject`` and the entities whose passages are read on the way."""
        chain, current = [], subject
        for relation in path:
            chain.append(current)
            current = self.entities[current].facts[relation]
        return current, tuple(chain)

    def all_questions(self) -> dict[int, list[SynthQuestion]]:
        """Every (template, subject) question, by hop count, in a fixed order."""
        by_hops: dict[int, list[SynthQuestion]] = {1: [], 2: [], 3: []}
        for kind, path, template in TEMPLATES:
            for name, entity in self.entities.items():
                if entity.kind == kind:
                    answer, chain = self.answer(name, path)
                    by_hops[len(path)].append(SynthQuestion(template.format(name), answer, chain))
        return by_hops

    def split_questions(self) -> dict[str, list[SynthQuestion]]:
        """Disjoint dev and train questions drawn with the hop mix (dev first, so dev does not depend on the
        train size)."""
        rng = np.random.default_rng([self.spec.seed, 1])
        pools = {hops: [qs[i] for i in rng.permutation(len(qs))] for hops, qs in self.all_questions().items()}
        splits = {}
        for split, total in (("dev", self.spec.dev_questions), ("train", self.spec.train_questions)):
            counts = _apportion(total, self.spec.hop_mix)
            chosen = []
            for hops, count in zip((1, 2, 3), counts, strict=True):
                if count > len(pools[hops]):
                    raise ValueError(f"the world has {len(pools[hops])} unused {hops}-hop questions left for {split}, "
                                     f"{count} asked: make the world bigger or ask fewer questions")
                chosen += pools[hops][:count]
                pools[hops] = pools[hops][count:]
            splits[split] = [chosen[i] for i in rng.permutation(len(chosen))]
        return splits


def _apportion(total: int, shares: tuple[float, ...]) -> list[int]:
    """Whole counts summing to ``total`` in proportion to ``shares`` (largest remainders)."""
    raw = np.asarray(shares) * total
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts))[: total - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


def _word(rng: np.random.Generator, low: int, high: int) -> str:
    return "".join(rng.choice(SYLLABLES, size=int(rng.integers(low, high + 1)))).capitalize()


def _place(rng: np.random.Generator) -> str:
    """City names; about a third share a word with another (``North Talmor``, ``Talmor Bay``)."""
    base = _word(rng, 2, 3)
    return str(rng.choice([base, base, f"North {base}", f"{base} Bay"]))


def _person_names(rng: np.random.Generator, n: int) -> list[str]:
    """Full names from small pools of first and last names, so many people share one of the two."""
    firsts = [_word(rng, 2, 2) for _ in range(max(4, n // 4))]
    lasts = [_word(rng, 2, 3) for _ in range(max(4, n // 4))]
    return [f"{rng.choice(firsts)} {rng.choice(lasts)}" for _ in range(4 * n)]


def _unique_names(rng: np.random.Generator, n: int, make, pool: list[str] | None = None) -> list[str]:
    names: dict[str, None] = {}
    candidates = iter(pool) if pool is not None else None
    for _ in range(100 * n):
        name = next(candidates) if candidates is not None else make()
        names.setdefault(name, None)
        if len(names) == n:
            return list(names)
    raise ValueError(f"could not draw {n} distinct names; ask for fewer entities")


def write_world(spec: WorldSpec, directory: str | os.PathLike) -> Path:
    """Write the world under ``directory``: ``wiki/paragraphs.jsonl`` and ``synthhop/{train,dev}.json``."""
    world, directory = World(spec), Path(directory)
    (directory / "wiki").mkdir(parents=True, exist_ok=True)
    (directory / "synthhop").mkdir(parents=True, exist_ok=True)
    with (directory / "wiki" / "paragraphs.jsonl").open("w", encoding="utf-8") as f:
        for i, name in enumerate(world.entities):
            f.write(json.dumps({"id": str(i), "contents": f'"{name}"\n{world.passage(name)}'}) + "\n")
    for split, questions in world.split_questions().items():
        rows = [{"_id": f"synthhop-{split}-{i}", "question": q.question, "answer": q.answer, "type": "bridge",
                 "hops": q.hops, "supporting_facts": [[title, 0] for title in q.chain]}
                for i, q in enumerate(questions)]
        (directory / "synthhop" / f"{split}.json").write_text(json.dumps(rows, indent=0), encoding="utf-8")
    (directory / "synthhop" / "world.json").write_text(json.dumps(asdict(spec)), encoding="utf-8")
    return directory


def world_data_dir(spec: WorldSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """The data directory of ``spec``'s world, written once into the cache (atomically, so concurrent
    processes agree)."""
    directory = Path(cache_dir or default_cache_dir()) / "synthhop" / spec.key
    if not (directory / "synthhop" / "world.json").exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{spec.key}.tmp", dir=directory.parent.mkdir(
            parents=True, exist_ok=True) or directory.parent))
        write_world(spec, staging)
        try:
            staging.rename(directory)
        except OSError:  # another process published it first
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def make_synthhop_env(split: str = "train", *, world: Mapping[str, Any] | None = None,
                      data_dir: str | os.PathLike | None = None, **env_kwargs: Any):
    """``gym.make("SynthHop-v0", world={...}, ...)``: a ``SearchQAEnv`` over a generated world. A
    ``data_dir`` that holds ``synthhop/`` files (``python -m envs.synthetic DIR``) is served as it is; any
    other (e.g. the real data directory) is ignored and the world of ``world`` (``WorldSpec`` fields) is
    generated into the cache."""
    from envs.search_qa import SearchQAEnv

    return SearchQAEnv("synthhop", split, data_dir=synthhop_data_dir(world, data_dir), **env_kwargs)


def synthhop_data_dir(world: Mapping[str, Any] | None = None, data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory ``make_synthhop_env`` serves: ``data_dir`` when it holds ``synthhop/`` files, else the
    cached world of ``world`` (``WorldSpec`` fields), written on first use."""
    if data_dir is not None and (Path(data_dir) / "synthhop" / "world.json").exists():
        return Path(data_dir)
    return world_data_dir(WorldSpec(**{k: tuple(v) if k == "hop_mix" else v for k, v in (world or {}).items()}))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a SynthHop world (corpus + questions) to a directory.")
    parser.add_argument("output")
    for name, default in asdict(WorldSpec()).items():
        if name != "hop_mix":
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--hop-mix", type=float, nargs=3, default=WorldSpec().hop_mix)
    args = vars(parser.parse_args())
    out = args.pop("output")
    print(write_world(WorldSpec(**{**args, "hop_mix": tuple(args["hop_mix"])}), out))
