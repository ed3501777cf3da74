"""The words a generated world is made of: syllables, given names, company words and kinds, occupations, and the
seeded draws of distinct names from them."""

from __future__ import annotations

import numpy as np

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


def syllable_word(rng: np.random.Generator, low: int, high: int) -> str:
    """A capitalised word of ``low`` to ``high`` SYLLABLES."""
    return "".join(rng.choice(SYLLABLES, size=int(rng.integers(low, high + 1)))).capitalize()


def place_name(rng: np.random.Generator) -> str:
    """City names; about a third share a word with another (``North Talmor``, ``Talmor Bay``)."""
    base = syllable_word(rng, 2, 3)
    return str(rng.choice([base, base, f"North {base}", f"{base} Bay"]))


def person_names(rng: np.random.Generator, n: int) -> list[str]:
    """Full names from small pools of first and last names, so many people share one of the two."""
    firsts = [syllable_word(rng, 2, 2) for _ in range(max(4, n // 4))]
    lasts = [syllable_word(rng, 2, 3) for _ in range(max(4, n // 4))]
    return [f"{rng.choice(firsts)} {rng.choice(lasts)}" for _ in range(4 * n)]


def unique_names(rng: np.random.Generator, n: int, make, pool: list[str] | None = None) -> list[str]:
    """``n`` distinct names, in the order first drawn: from ``pool`` in order where given, else from ``make()``."""
    names: dict[str, None] = {}
    candidates = iter(pool) if pool is not None else None
    for _ in range(100 * n):
        name = next(candidates) if candidates is not None else make()
        names.setdefault(name, None)
        if len(names) == n:
            return list(names)
    raise ValueError(f"could not draw {n} distinct names; ask for fewer entities")

