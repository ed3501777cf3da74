"""A generated world from its spec: the specs (``WorldSpec`` for SynthHop, ``BranchSpec`` for SynthBranch), the
entities and their passages, every question the templates ask and the seeded draw of the train and dev splits."""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from envs.synthetic.names import (
    COMPANY_KINDS,
    COMPANY_WORDS,
    GIVEN_NAMES,
    OCCUPATIONS,
    person_names,
    place_name,
    syllable_word,
    unique_names,
)

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


def question_path(question: str) -> tuple[str, ...] | None:
    """The relation path of the ``TEMPLATES`` entry that asks ``question`` (the longest template that matches, so
    "the founder of X" is not read as the name of a person), None when no template asks it."""
    for _, path, template in sorted(TEMPLATES, key=lambda entry: -len(entry[2])):
        prefix, suffix = template.split("{}")
        if question.startswith(prefix) and question.endswith(suffix) and len(question) > len(prefix) + len(suffix):
            return path
    return None


PERSON_NAMES = ("syllables", "given")  # the ways a world names its people (``_WorldSizes.names``)
COMPANY_PASSAGES = ("prose", "roles")  # how a SynthBranch company's passage states its people (``BranchSpec``)
# Fields left out of a world's cache key at these values, so worlds cached before the field existed keep their key
_KEY_DEFAULTS = {"names": "syllables", "passages": "prose", "lead": False}

# SynthBranch: the relations after the routing decision (founder or chair) by the hops from the company, and the
# question (its company's place: the company's name, or with a lead hop "the company X works for")
BRANCH_ROLES = ("founder", "chair")
BRANCH_TAILS: dict[int, tuple[tuple[str, ...], str]] = {
    2: (("born_in",), "In which city was the {} of {} born?"),
    3: (("born_in", "country"), "In which country was the {} of {} born?"),
    4: (("spouse", "born_in", "country"), "In which country was the spouse of the {} of {} born?"),
}


@dataclass(frozen=True)
class _WorldSizes:
    """The seed and sizes every generated world has (its entities and its two splits), and how people are named
    (``names``: ``syllables``, first and last names made of SYLLABLES, which people share; ``given``, one word
    each from GIVEN_NAMES, at most that many people)."""

    seed: int = 0
    people: int = 200
    companies: int = 100
    cities: int = 40
    countries: int = 12
    train_questions: int = 800
    dev_questions: int = 150
    names: str = "syllables"

    def __post_init__(self) -> None:
        for spec_field in fields(self):
            value = getattr(self, spec_field.name)
            if spec_field.type == "int":  # a string: annotations are postponed
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise ValueError(f"{spec_field.name} must be an int, got {type(value).__name__} {value!r}")
                object.__setattr__(self, spec_field.name, int(value))  # numpy's too: the key is JSON
        if self.seed < 0:
            raise ValueError(f"seed must be a non-negative int (numpy's generators take no other), got {self.seed}")
        if self.people < 2 or self.people % 2:
            raise ValueError(f"people must be an even number >= 2 (they marry in pairs), got {self.people}")
        if self.names not in PERSON_NAMES:
            raise ValueError(f"names must be one of {', '.join(PERSON_NAMES)}, got {self.names!r}")
        if self.names == "given" and self.people > len(GIVEN_NAMES):
            raise ValueError(f"people must be <= {len(GIVEN_NAMES)} with names 'given' (one given name each), got "
                             f"{self.people}")
        for name in ("companies", "cities", "countries", "train_questions", "dev_questions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def key(self) -> str:
        """A short hash naming this world's files in the cache (fields at their ``_KEY_DEFAULTS`` left out, so
        worlds cached before those fields existed keep their key)."""
        values = {k: v for k, v in asdict(self).items() if _KEY_DEFAULTS.get(k, object()) != v}
        return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class WorldSpec(_WorldSizes):
    """Sizes and seed of a SynthHop world. ``hop_mix``: the shares of 1-, 2- and 3-hop questions."""

    DATASET: ClassVar[str] = "synthhop"

    hop_mix: tuple[float, float, float] = (0.3, 0.4, 0.3)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.hop_mix) != 3 or min(self.hop_mix) < 0 or not np.isclose(sum(self.hop_mix), 1.0):
            raise ValueError(f"hop_mix must be three shares summing to 1, got {self.hop_mix}")

    def world(self) -> World:
        return World(self)


@dataclass(frozen=True)
class BranchSpec(_WorldSizes):
    """Sizes and seed of a SynthBranch world; ``hops``: the searches every question needs (2, 3 or 4), the first
    of them followed by the routing decision. Each company asks two questions (its founder's, its chair's).
    ``lead``: the question names a person who works for the company instead of the company ("the chair of the
    company Mary works for"), whose passage is searched first, so the decision follows the second search (``hops``
    3, 4 or 5, the lead's search included).
    ``passages``: how a company's passage names its two people, ``prose`` ("It was founded in 1874 by Mary and is
    chaired by John.") or ``roles``, in the questions' words ("The founder of Brightwater Guild is Mary. The chair
    of Brightwater Guild is John."), so that a policy restating the role it follows ("The chair of Brightwater
    Guild is") continues with the passage's own next token: the name, copied by induction."""

    DATASET: ClassVar[str] = "synthbranch"

    companies: int = 150
    train_questions: int = 240
    dev_questions: int = 60
    hops: int = 3
    passages: str = "prose"
    lead: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.passages not in COMPANY_PASSAGES:
            raise ValueError(f"passages must be one of {', '.join(COMPANY_PASSAGES)}, got {self.passages!r}")
        if self.tail_hops not in BRANCH_TAILS:
            allowed = sorted(hops + self.lead for hops in BRANCH_TAILS)
            raise ValueError(f"hops must be one of {allowed} (searches per question"
                             f"{', the lead hop included' if self.lead else ''}), got {self.hops}")
        ends = "cities" if self.tail_hops == 2 else "countries"
        if getattr(self, ends) < 2:
            raise ValueError(f"{ends} must be >= 2 with hops {self.hops}: the wrong route must end elsewhere than "
                             f"the right one, got {getattr(self, ends)}")
        asked, available = self.train_questions + self.dev_questions, len(BRANCH_ROLES) * self.companies
        if asked > available:
            raise ValueError(f"train_questions + dev_questions ({asked}) exceed the {available} questions of "
                             f"{self.companies} companies (a founder's and a chair's each): raise companies or ask "
                             f"fewer questions")
        if self.lead and self.people < self.companies + 2:
            raise ValueError(f"people must be >= companies + 2 with lead (each company's lead works for it alone and "
                             f"is neither its founder nor its chair), got {self.people} people, {self.companies} "
                             f"companies")

    @property
    def tail_hops(self) -> int:
        """The searches from the company on: ``hops`` without the lead's."""
        return self.hops - self.lead

    @property
    def decision_hop(self) -> int:
        """The search (0-based, among a question's supporting titles) whose person the routing decision picks: the
        one after the company's. The step that makes it is the trajectory's ``decision_hop + 1``-th."""
        return 1 + self.lead

    def world(self) -> BranchWorld:
        return BranchWorld(self)



SPECS: dict[str, type[WorldSpec] | type[BranchSpec]] = {"synthhop": WorldSpec, "synthbranch": BranchSpec}


def spec_from_fields(dataset: str, values: Mapping[str, Any] | None) -> WorldSpec | BranchSpec:
    """The spec of ``dataset`` (synthhop or synthbranch) from its fields (``world.json``, ``gym.make``'s
    ``world={...}``; lists for tuples); a ``ValueError`` naming a field it does not have."""
    spec_class = SPECS[dataset]
    known = {f.name for f in fields(spec_class)}
    unknown = sorted(set(values or {}) - known)
    if unknown:
        raise ValueError(f"{dataset} worlds have no field {', '.join(unknown)}; fields: {', '.join(sorted(known))}")
    return spec_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in (values or {}).items()})


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
    decoy: SynthQuestion | None = None  # SynthBranch: the same question's wrong route (its chain and answer)
    role: str | None = None  # SynthBranch: the person the question asks about (one of BRANCH_ROLES)

    @property
    def hops(self) -> int:
        return len(self.chain)


class World:
    """The entities of a ``WorldSpec``, their passages and every question the templates can ask."""

    def __init__(self, spec: WorldSpec | BranchSpec):
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        countries = unique_names(rng, spec.countries, lambda: syllable_word(rng, 2, 3))
        cities = unique_names(rng, spec.cities, lambda: place_name(rng))
        pool = person_names(rng, spec.people) if spec.names == "syllables" else rng.permutation(GIVEN_NAMES).tolist()
        people = unique_names(rng, spec.people, lambda: None, pool=pool)
        companies = unique_names(rng, spec.companies, lambda: f"{syllable_word(rng, 2, 3)} {rng.choice(COMPANY_WORDS)}")
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
        return _draw_splits(self.spec, {f"{hops}-hop": qs for hops, qs in self.all_questions().items()},
                            self.spec.hop_mix)


class BranchWorld(World):
    """A SynthBranch world: the entities of the SynthHop world of the same sizes and seed, and a chair per company
    (drawn with a generator of its own, so the shared entities are the same), whose route ends elsewhere than the
    founder's. Every question asks about the founder or the chair; its decoy is the other one's route. With
    ``spec.lead`` each company has one employee (neither its founder nor its chair; a generator of its own), whose
    passage says where they work, and whom its questions name."""

    def __init__(self, spec: BranchSpec):
        super().__init__(WorldSpec(spec.seed, spec.people, spec.companies, spec.cities, spec.countries,
                                   names=spec.names))
        self.spec = spec
        tail = BRANCH_TAILS[spec.tail_hops][0]
        rng = np.random.default_rng([spec.seed, 2])
        people = [name for name, e in self.entities.items() if e.kind == "person"]
        ends = {name: self.answer(name, tail)[0] for name in people}
        for name, e in list(self.entities.items()):
            if e.kind != "company":
                continue
            founder = e.facts["founder"]
            elsewhere = [person for person in people if ends[person] != ends[founder]]
            if not elsewhere:
                raise ValueError(f"every person's route ends in {ends[founder]}: a world of {spec.cities} cities and "
                                 f"{spec.countries} countries is too small for hops {spec.hops} (the wrong route must "
                                 f"end elsewhere): raise cities or countries")
            self.entities[name] = Entity(name, "company", {**e.facts, "chair": str(rng.choice(elsewhere))}, e.detail)
        self.employee: dict[str, str] = {}  # company -> the person its questions name (``spec.lead``)
        if spec.lead:
            rng = np.random.default_rng([spec.seed, 3])
            employed: set[str] = set()
            for name, e in list(self.entities.items()):
                if e.kind != "company":
                    continue
                free = [p for p in people if p not in employed and p not in (e.facts["founder"], e.facts["chair"])]
                employee = str(rng.choice(free))
                employed.add(employee)
                person = self.entities[employee]
                self.entities[employee] = Entity(employee, "person", {**person.facts, "employer": name}, person.detail)
                self.employee[name] = employee

    def passage(self, name: str) -> str:
        e = self.entities[name]
        if e.kind == "person" and "employer" in e.facts:
            return f"{super().passage(name)} {name} works for {e.facts['employer']}."
        if e.kind != "company":
            return super().passage(name)
        kind, year = e.detail.split(", ")
        if self.spec.passages == "roles":
            return (f"{name} is a {kind} based in {e.facts['based_in']}, {year}. "
                    + " ".join(f"The {role} of {name} is {e.facts[role]}." for role in BRANCH_ROLES))
        return (f"{name} is a {kind} based in {e.facts['based_in']}. It was {year} by {e.facts['founder']} and is "
                f"chaired by {e.facts['chair']}.")

    def role_questions(self) -> dict[str, list[SynthQuestion]]:
        """Every company's founder and chair question, by role, each with its decoy, in a fixed order."""
        tail, template = BRANCH_TAILS[self.spec.tail_hops]
        by_role: dict[str, list[SynthQuestion]] = {role: [] for role in BRANCH_ROLES}
        for name, entity in self.entities.items():
            if entity.kind != "company":
                continue
            subject, lead, named = name, (), name
            if self.spec.lead:
                subject, lead = self.employee[name], ("employer",)
                named = f"the company {subject} works for"
            for role, other in zip(BRANCH_ROLES, BRANCH_ROLES[::-1], strict=True):
                question = template.format(role, named)
                wrong = SynthQuestion(question, *self.answer(subject, (*lead, other, *tail)))
                by_role[role].append(SynthQuestion(question, *self.answer(subject, (*lead, role, *tail)), decoy=wrong,
                                                   role=role))
        return by_role

    def split_questions(self) -> dict[str, list[SynthQuestion]]:
        """Disjoint dev and train questions, half about founders and half about chairs (dev first)."""
        return _draw_splits(self.spec, self.role_questions(), (0.5, 0.5))


def _draw_splits(spec: WorldSpec | BranchSpec, pools: dict[str, list[SynthQuestion]],
                 shares: tuple[float, ...]) -> dict[str, list[SynthQuestion]]:
    """Dev then train questions drawn from ``pools`` (kind -> questions) in proportion to ``shares``, without
    reuse, each split shuffled; seeded by the spec."""
    rng = np.random.default_rng([spec.seed, 1])
    pools = {kind: [qs[i] for i in rng.permutation(len(qs))] for kind, qs in pools.items()}
    splits = {}
    for split, total in (("dev", spec.dev_questions), ("train", spec.train_questions)):
        chosen = []
        for kind, count in zip(pools, _apportion(total, shares), strict=True):
            if count > len(pools[kind]):
                raise ValueError(f"the world has {len(pools[kind])} unused {kind} questions left for {split}, "
                                 f"{count} asked: make the world bigger or ask fewer questions")
            chosen += pools[kind][:count]
            pools[kind] = pools[kind][count:]
        splits[split] = [chosen[i] for i in rng.permutation(len(chosen))]
    return splits


def _apportion(total: int, shares: tuple[float, ...]) -> list[int]:
    """Whole counts summing to ``total`` in proportion to ``shares`` (largest remainders)."""
    raw = np.asarray(shares) * total
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts))[: total - counts.sum()]:
        counts[i] += 1
    return counts.tolist()
