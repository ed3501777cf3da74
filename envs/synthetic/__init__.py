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

The package: ``names`` (the words worlds are made of), ``world`` (specs, entities, passages, questions, splits),
``files`` (a world's files and its cache), ``env`` (the registered envs), ``cli`` (``python -m envs.synthetic``).
"""

from envs.synthetic.cli import main
from envs.synthetic.env import make_synthbranch_env, make_synthhop_env, world_dir
from envs.synthetic.files import branch_questions, read_spec, world_data_dir, write_world
from envs.synthetic.names import COMPANY_KINDS, COMPANY_WORDS, GIVEN_NAMES, OCCUPATIONS, SYLLABLES
from envs.synthetic.world import (
    BRANCH_ROLES,
    BRANCH_TAILS,
    COMPANY_PASSAGES,
    PERSON_NAMES,
    SPECS,
    TEMPLATES,
    BranchSpec,
    BranchWorld,
    Entity,
    SynthQuestion,
    World,
    WorldSpec,
    question_path,
    spec_from_fields,
)

__all__ = [
    "BRANCH_ROLES", "BRANCH_TAILS", "COMPANY_KINDS", "COMPANY_PASSAGES", "COMPANY_WORDS", "GIVEN_NAMES", "OCCUPATIONS",
    "PERSON_NAMES", "SPECS", "SYLLABLES", "TEMPLATES", "BranchSpec", "BranchWorld", "Entity", "SynthQuestion", "World",
    "WorldSpec", "branch_questions", "main", "make_synthbranch_env", "make_synthhop_env", "question_path",
    "read_spec", "spec_from_fields", "world_data_dir", "world_dir", "write_world",
]
