"""Generated worlds: SynthHop, a seeded fictional world whose 1-, 2- and 3-hop questions need chained searches,
and SynthBranch, its variant whose every question turns on one routing decision (``make_synthbranch_env``).

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

SynthBranch (``BranchSpec``, files under ``synthbranch/``) is the same kind of world in which every company also
has a chair, named beside its founder in the company's passage; its questions ask about the founder or the chair
(see ``make_synthbranch_env``). Either world can name its people by one given name each (``names="given"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from envs.cache import default_cache_dir

SYLLABLES = ("ka", "ren", "vo", "mi", "tal", "dor", "sa", "lin", "bra", "nu", "kel", "ta", "vi", "mor", "el",
             "an", "is", "ga", "ru", "fen", "lo", "quin", "ze", "har", "to", "wyn", "bel", "cor", "da", "ith")
# Common given names that SmolLM2's tokenizer encodes as one token after a space (tests/test_synthetic.py checks
# each), none spelled by SYLLABLES: ``names="given"`` names each person by one of them, so choosing a person is
# one token and no blend of two names can be written
GIVEN_NAMES = (
    "James", "Mary", "John", "Patricia", "Robert", "Jennifer", "Michael", "William", "Elizabeth", "David",
    "Barbara", "Richard", "Susan", "Joseph", "Jessica", "Thomas", "Sarah", "Charles", "Christopher", "Nancy",
    "Daniel", "Lisa", "Matthew", "Betty", "Anthony", "Margaret", "Mark", "Sandra", "Donald", "Ashley", "Steven",
    "Paul", "Emily", "Andrew", "Joshua", "Michelle", "Kenneth", "Dorothy", "Kevin", "Carol", "Brian", "Amanda",
    "George", "Melissa", "Edward", "Deborah", "Ronald", "Stephanie", "Timothy", "Rebecca", "Jason", "Sharon",
    "Jeffrey", "Laura", "Ryan", "Jacob", "Kathleen", "Gary", "Amy", "Nicholas", "Shirley", "Eric", "Angela",
    "Jonathan", "Helen", "Stephen", "Anna", "Larry", "Justin", "Scott", "Nicole", "Emma", "Benjamin",
    "Samantha", "Samuel", "Katherine", "Gregory", "Christine", "Frank", "Alexander", "Rachel", "Raymond",
    "Catherine", "Patrick", "Jack", "Janet", "Dennis", "Ruth", "Jerry", "Maria", "Tyler", "Heather", "Aaron",
    "Diane", "Jose", "Virginia", "Adam", "Julie", "Henry", "Joyce", "Nathan", "Victoria", "Douglas", "Olivia",
    "Kelly", "Peter", "Christina", "Lauren", "Walter", "Joan", "Ethan", "Jeremy", "Judith", "Harold", "Keith",
    "Christian", "Andrea", "Roger", "Hannah", "Noah", "Martha", "Gerald", "Carl", "Frances", "Terry", "Sean",
    "Ann", "Austin", "Teresa", "Arthur", "Lawrence", "Sara", "Jesse", "Jean", "Bryan", "Alice", "Joe",
    "Madison", "Jordan", "Billy", "Abigail", "Bruce", "Julia", "Albert", "Judy", "Grace", "Gabriel", "Logan",
    "Alan", "Juan", "Wayne", "Roy", "Ralph", "Sophia", "Marie", "Eugene", "Diana", "Vincent", "Russell",
    "Elijah", "Isabella", "Louis", "Charlotte", "Bobby", "Rose", "Philip", "Johnny", "Oscar", "Leo", "Max",
    "Felix", "Hugo", "Victor", "Oliver", "Lucas", "Simon", "Martin", "Hans", "Karl", "Otto", "Anton", "Ivan",
    "Boris", "Pierre", "Marco", "Pablo", "Carlos", "Luis", "Miguel", "Ahmed", "Omar", "Ali", "Hassan", "Raj",
    "Kim", "Lee", "Chen", "Anne", "Clara", "Sofia", "Nina", "Eva", "Vera", "Lucy", "Ella", "Lily", "Ruby",
    "Iris", "Daisy", "Holly", "Ivy", "Jane", "Kate", "Ellen", "Edith", "Agnes", "Alma",
)
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


PERSON_NAMES = ("syllables", "given")  # the ways a world names its people (``_WorldSizes.names``)
COMPANY_PASSAGES = ("prose", "roles")  # how a SynthBranch company's passage states its people (``BranchSpec``)
# Fields left out of a world's cache key at these values, so worlds cached before the field existed keep their key
_KEY_DEFAULTS = {"names": "syllables", "passages": "prose"}

# SynthBranch: the relations after the routing decision (founder or chair) by hop count, and the question
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.passages not in COMPANY_PASSAGES:
            raise ValueError(f"passages must be one of {', '.join(COMPANY_PASSAGES)}, got {self.passages!r}")
        if self.hops not in BRANCH_TAILS:
            raise ValueError(f"hops must be one of {sorted(BRANCH_TAILS)} (searches per question), got {self.hops}")
        ends = "cities" if self.hops == 2 else "countries"
        if getattr(self, ends) < 2:
            raise ValueError(f"{ends} must be >= 2 with hops {self.hops}: the wrong route must end elsewhere than "
                             f"the right one, got {getattr(self, ends)}")
        asked, available = self.train_questions + self.dev_questions, len(BRANCH_ROLES) * self.companies
        if asked > available:
            raise ValueError(f"train_questions + dev_questions ({asked}) exceed the {available} questions of "
                             f"{self.companies} companies (a founder's and a chair's each): raise companies or ask "
                             f"fewer questions")

    def world(self) -> BranchWorld:
        return BranchWorld(self)


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
        countries = _unique_names(rng, spec.countries, lambda: _word(rng, 2, 3))
        cities = _unique_names(rng, spec.cities, lambda: _place(rng))
        pool = _person_names(rng, spec.people) if spec.names == "syllables" else rng.permutation(GIVEN_NAMES).tolist()
        people = _unique_names(rng, spec.people, lambda: None, pool=pool)
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
        return _draw_splits(self.spec, {f"{hops}-hop": qs for hops, qs in self.all_questions().items()},
                            self.spec.hop_mix)


class BranchWorld(World):
    """A SynthBranch world: the entities of the SynthHop world of the same sizes and seed, and a chair per company
    (drawn with a generator of its own, so the shared entities are the same), whose route ends elsewhere than the
    founder's. Every question asks about the founder or the chair; its decoy is the other one's route."""

    def __init__(self, spec: BranchSpec):
        super().__init__(WorldSpec(spec.seed, spec.people, spec.companies, spec.cities, spec.countries,
                                   names=spec.names))
        self.spec = spec
        tail = BRANCH_TAILS[spec.hops][0]
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

    def passage(self, name: str) -> str:
        e = self.entities[name]
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
        tail, template = BRANCH_TAILS[self.spec.hops]
        by_role: dict[str, list[SynthQuestion]] = {role: [] for role in BRANCH_ROLES}
        for name, entity in self.entities.items():
            if entity.kind != "company":
                continue
            for role, other in zip(BRANCH_ROLES, BRANCH_ROLES[::-1], strict=True):
                question = template.format(role, name)
                wrong = SynthQuestion(question, *self.answer(name, (other, *tail)))
                by_role[role].append(SynthQuestion(question, *self.answer(name, (role, *tail)), decoy=wrong,
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


def write_world(spec: WorldSpec | BranchSpec, directory: str | os.PathLike) -> Path:
    """Write the world under ``directory``: ``wiki/paragraphs.jsonl`` and ``DATASET/{train,dev}.json`` (DATASET:
    synthhop or synthbranch), with the spec as ``DATASET/world.json``."""
    world, directory, dataset = spec.world(), Path(directory), spec.DATASET
    (directory / "wiki").mkdir(parents=True, exist_ok=True)
    (directory / dataset).mkdir(parents=True, exist_ok=True)
    with (directory / "wiki" / "paragraphs.jsonl").open("w", encoding="utf-8") as f:
        for i, name in enumerate(world.entities):
            f.write(json.dumps({"id": str(i), "contents": f'"{name}"\n{world.passage(name)}'}) + "\n")
    for split, questions in world.split_questions().items():
        rows = [{"_id": f"{dataset}-{split}-{i}", "question": q.question, "answer": q.answer, "type": "bridge",
                 "hops": q.hops, "supporting_facts": [[title, 0] for title in q.chain]}
                for i, q in enumerate(questions)]
        (directory / dataset / f"{split}.json").write_text(json.dumps(rows, indent=0), encoding="utf-8")
    (directory / dataset / "world.json").write_text(json.dumps(asdict(spec)), encoding="utf-8")
    return directory


def read_spec(dataset: str, data_dir: str | os.PathLike) -> WorldSpec | BranchSpec:
    """The spec of the ``dataset`` world written in ``data_dir`` (its ``DATASET/world.json``)."""
    return spec_from_fields(dataset, json.loads((Path(data_dir) / dataset / "world.json").read_text()))


def branch_questions(data_dir: str | os.PathLike, split: str, served: Sequence[str]) -> list[SynthQuestion]:
    """The questions of ``split`` of the SynthBranch world written in ``data_dir``, each with its decoy (the wrong
    route), for an env that serves the question texts ``served`` (in order); a ``ValueError`` when they are not
    the questions of ``data_dir``'s ``world.json``."""
    questions = read_spec("synthbranch", data_dir).world().split_questions()[split]
    if [q.question for q in questions] != list(served):
        raise ValueError(f"{data_dir}: the synthbranch {split} questions are not those of its world.json")
    return questions


def world_data_dir(spec: WorldSpec | BranchSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """The data directory of ``spec``'s world, written once into the cache (atomically, so concurrent
    processes agree)."""
    directory = Path(cache_dir or default_cache_dir()) / spec.DATASET / spec.key
    if not (directory / spec.DATASET / "world.json").exists():
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
    return _world_env("synthhop", split, world, data_dir, env_kwargs)


def make_synthbranch_env(split: str = "train", *, world: Mapping[str, Any] | None = None,
                         data_dir: str | os.PathLike | None = None, **env_kwargs: Any):
    """``gym.make("SynthBranch-v0", world={...}, ...)``: search QA over a SynthBranch world, where every question
    turns on one decision taken after the first search, and which way is right differs between questions.

    ## Description
    Each company has a founder and a chair, both named in its passage: "Brightwater Guild is a guild based in
    Quellmoor. It was founded in 1874 by Varno Keld and is chaired by Tal Mirren." Every question asks about one of
    them, e.g. (``hops`` 3) "In which country was the chair of Brightwater Guild born?": search the company, then
    the person the question's wording names (the routing decision), then that person's birth city; answer its
    country. The other person's route ends in another country (the world is drawn so), so following the wrong
    name gives a wrong answer in the right format. Half the questions of each split ask about founders, half about
    chairs, so no fixed rule ("the first name") is right more than half the time. ``hops`` 2 asks the birth city,
    4 the birth country of the person's spouse.

    ## Action Space, Observation Space, Rewards, Episode End
    Those of ``SearchQAEnv`` (``UnicodeText`` actions and observations: the step's text, and the retrieved
    passages or the final ""; Search-R1's format-aware exact-match reward at the end; ``terminated`` on an
    answer, ``truncated`` when the final, answer-only step (turn ``max_turns + 1``) holds none). A question needs
    ``hops`` searches: ``max_turns`` must be at least ``hops`` (run.py refuses less before Ray starts). With
    ``hops`` 3 and the paper's ``max_turns`` 3, a trajectory is 3 searches and the answer: 4 LLM calls.

    ## Why step-level credit matters here
    The decision is one step in the middle of a 3-4 step trajectory: everything before it is the same on both
    routes and everything after it is copying names. A start policy that routes wrong most of the time
    (``experiments/warmstart.py --misroute``) rarely samples the right route, so chains of a group mostly share
    one outcome. A tree that branches after the first search (the node before the decision) makes siblings that
    share that search and differ in the decision alone; their reward difference credits that one step, and the
    expansion costs the rest of a chain only, not a whole one. Where a strategy branches (``--branching``) decides
    how often that node is expanded.

    ## Arguments
    ``world``: ``BranchSpec`` fields (``hops``, sizes, seed, ``names``, ``passages``), generated into the cache; with
    ``names="given"`` every person is one common given name ("founded in 1874 by Mary and is chaired by John"), one
    token for SmolLM2's tokenizer, so the decision is a single token and no blend of the two names can be written
    (the branching benchmark's world); with ``passages="roles"`` a company's passage names them in the questions'
    words ("The founder of Brightwater Guild is Mary. The chair of Brightwater Guild is John."). A ``data_dir`` holding
    ``synthbranch/`` files (``python -m envs.synthetic DIR --dataset synthbranch``) is served as it is. Every
    other keyword goes to ``SearchQAEnv``.

    ## Version History
    * v0: initial version.
    """
    return _world_env("synthbranch", split, world, data_dir, env_kwargs)


def _world_env(dataset: str, split: str, world: Mapping[str, Any] | None, data_dir: str | os.PathLike | None,
               env_kwargs: dict[str, Any]):
    from envs.search_qa import SearchQAEnv

    return SearchQAEnv(dataset, split, data_dir=world_dir(dataset, world, data_dir), **env_kwargs)


def world_dir(dataset: str, world: Mapping[str, Any] | None = None,
              data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory a ``dataset`` (synthhop, synthbranch) env serves: ``data_dir`` when it holds that
    dataset's files, else the cached world of ``world`` (the spec's fields), written on first use."""
    if data_dir is not None and (Path(data_dir) / dataset / "world.json").exists():
        return Path(data_dir)
    return world_data_dir(spec_from_fields(dataset, world))


SPECS: dict[str, type[WorldSpec] | type[BranchSpec]] = {"synthhop": WorldSpec, "synthbranch": BranchSpec}


def main(argv: list[str] | None = None) -> Path:
    """``python -m envs.synthetic DIR [--dataset synthbranch] [--FIELD VALUE ...]``: write a world."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a generated world (corpus + questions) to a directory.")
    parser.add_argument("output")
    parser.add_argument("--dataset", choices=list(SPECS), default="synthhop")
    for name in dict.fromkeys(f.name for spec in SPECS.values() for f in fields(spec)):
        if name not in ("hop_mix", "names", "passages"):
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--hop-mix", type=float, nargs=3, default=None)
    parser.add_argument("--names", choices=PERSON_NAMES, default=None, help="how people are named")
    parser.add_argument("--passages", choices=COMPANY_PASSAGES, default=None,
                        help="how a SynthBranch company's passage names its people")
    args = vars(parser.parse_args(argv))
    output, dataset = args.pop("output"), args.pop("dataset")
    try:
        spec = spec_from_fields(dataset, {k: v for k, v in args.items() if v is not None})
        spec.world().split_questions()  # a world too small for its questions fails here, before anything is written
    except ValueError as error:
        parser.error(str(error))
    return write_world(spec, output)


if __name__ == "__main__":
    print(main())
