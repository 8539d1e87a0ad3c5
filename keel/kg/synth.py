"""A seeded Freebase-like KG with CWQ-like questions, small enough to learn on CPU.

Paper B trains on CWQ over full Freebase (3,531 test questions, a 7B model, GPUs). This
generator keeps the interface's hard parts — opaque `m.0xxxx` ids, dotted relation names,
nameless CVT mediator nodes (`film.performance`, `people.marriage`), numeric attributes, the
four CWQ question types (composition, conjunction, comparative, superlative) — and shrinks the
rest: 14 relations, a few thousand triples, 1–3 tool turns per question with at most 6 calls
per turn, templated English that names the relation, so SmolLM2-135M can learn it in minutes.

Every question's gold turns and answers come from executing its plan (`keel.kg.oracle`) on the
generated graph, so the labels and the KG cannot disagree. Same seed → byte-identical files.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from keel.config import QUESTION_KINDS
from keel.errors import UserError
from keel.kg.base import HEAD_ENTITIES as HEAD, TAIL_ENTITIES as TAIL
from keel.kg.oracle import run_plan
from keel.kg.store import NAME_RELATION, MemoryStore
from keel.types import Task

PLACE_OF_BIRTH = "people.person.place_of_birth"
NATIONALITY = "people.person.nationality"
DATE_OF_BIRTH = "people.person.date_of_birth"
PROFESSION = "people.person.profession"
SPOUSE_S = "people.person.spouse_s"  # person -> people.marriage CVT
MARRIAGE_SPOUSE = "people.marriage.spouse"  # CVT -> both spouses (as in Freebase)
DIRECTED_BY = "film.film.directed_by"
STARRING = "film.film.starring"  # film -> film.performance CVT
PERFORMANCE_ACTOR = "film.performance.actor"
RELEASE_YEAR = "film.film.release_year"
GENRE = "film.film.genre"
CONTAINEDBY = "location.location.containedby"
CAPITAL = "location.country.capital"
POPULATION = "location.location.population"
RELATIONS = sorted(
    [PLACE_OF_BIRTH, NATIONALITY, DATE_OF_BIRTH, PROFESSION, SPOUSE_S, MARRIAGE_SPOUSE, DIRECTED_BY,
     STARRING, PERFORMANCE_ACTOR, RELEASE_YEAR, GENRE, CONTAINEDBY, CAPITAL, POPULATION]
)

_ID_CHARS = "0123456789bcdfghjklmnpqrstvwxyz_"  # Freebase mids use digits, consonants and "_"
_FIRST = ("Ada Bram Cora Dario Elin Felix Greta Hugo Ines Jonas Kira Lukas Mara Nils Olga Piet Rhea Sven "
          "Tilda Umar Vera Wim Yara Zeno Alma Basil Clio Dmitri Edda Fabian Gwen Hal Ilse Jasper Katya Leon "
          "Mina Otto Pia Rufus").split()
_LAST = ("Abbot Brandt Castell Dorn Eckhart Falk Greer Hollis Ivers Jaeger Kessler Lund Marlow Nyberg Oakes "
         "Pryor Quill Rourke Sallow Thorne Ulner Vance Wexler Yates Zoller Ashby Birch Crane Dunmore Ellery "
         "Fenwick Garland Hale Ingram Jessop Keane Lowell Mercer Norcross Osric Penrose Radley Stroud Tarrant "
         "Upton Voss Whitlock Yardley Ziegler Alder Blythe Corwin Drayton Everly Frost").split()
_SYLLABLES = "ka lo ri ve san tor mel dra gan pe ul cas bri no tha vin es ard mor len qui zel".split()
_FILM_ADJ = "Silent Broken Golden Hidden Last Crimson Distant Frozen Hollow Burning Quiet Lost Iron Pale Wild Bitter".split()
_FILM_NOUN = "River Harbor Mirror Garden Winter Signal Orchard Lantern Bridge Tide Crown Meadow Engine Compass Valley Ember".split()
GENRES = ("drama", "comedy", "thriller", "western", "musical", "documentary", "horror", "romance")
PROFESSIONS = ("actor", "writer", "painter", "engineer", "physician", "lawyer", "musician", "architect")


@dataclass
class SynthConfig:
    """Size of the generated graph (defaults: about 5,000 triples)."""

    countries: int = 24
    """Countries; each has a capital among its cities."""
    cities: int = 120
    """Cities, spread over the countries (about 5 each, so a country's cities fit in one turn of calls), each with a population."""
    people: int = 700
    """People, each with a place of birth, nationality, birth year and profession."""
    directors: int = 110
    """People who direct films (each directs 2–6)."""
    films: int = 420
    """Films, each with a director, release year, 1–2 genres and 2–4 performances."""
    marriages: int = 180
    """people.marriage CVT nodes, each linking two people."""
    max_calls_per_turn: int = 6
    """Questions needing more parallel calls in one turn are not generated (short trajectories)."""
    kinds: tuple[str, ...] = QUESTION_KINDS
    """Question kinds generated (CWQ's four); a subset gives a simpler slice of the same graph and interface."""
    max_hops: int = 0
    """Questions whose gold needs more tool turns (hops) than this are not generated; 0: no limit."""
    templates: tuple[str, ...] = ()
    """Question templates kept (names in keel.config.QUESTION_TEMPLATES); empty: every template of `kinds`."""
    nationality_from_birth: float = 0.8
    """Share of people whose nationality is their birth city's country (the others draw a country at
    random, which is the birth country 1 time in `countries`). At 0.8, as in Freebase, "which country
    contains X's place of birth" is answered 80% of the time by the one-hop shortcut X's nationality,
    and "the capital of that country" in two hops instead of three; GRPO was seen taking that
    shortcut (LOG.md, 2026-12-01, seventh session). 0: the two relations are independent (agree 1 in
    `countries` times by chance)."""


# --- the graph ------------------------------------------------------------------------------
@dataclass
class SynthKG:
    store: MemoryStore
    aliases: dict[str, list[str]]  # id -> aliases
    kind_of: dict[str, str]  # id -> person / film / city / country / genre / profession
    people: list[str]
    directors: list[str]
    films: list[str]
    cities: list[str]
    countries: list[str]


def build_kg(seed: int = 0, config: SynthConfig | None = None) -> SynthKG:
    """The seeded graph. Identical for the same seed and config."""
    c = config or SynthConfig()
    rng = random.Random(seed)
    side = random.Random(seed * 7919 + 3)  # draws that only non-default settings make (nationality_from_birth)
    used_ids: set[str] = set()

    def new_id() -> str:
        while True:
            mid = "m.0" + "".join(rng.choice(_ID_CHARS) for _ in range(5))
            if mid not in used_ids:
                used_ids.add(mid)
                return mid

    used_names: set[str] = set()

    def unique(make: Callable[[], str]) -> str:
        for _ in range(10_000):
            name = make()
            if name not in used_names:
                used_names.add(name)
                return name
        raise RuntimeError("synth: ran out of distinct names; lower the sizes in SynthConfig")

    def place_name() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()

    triples: list[tuple[str, str, str]] = []
    names: dict[str, str] = {}
    aliases: dict[str, list[str]] = {}
    kind_of: dict[str, str] = {}

    def entity(kind: str, name: str) -> str:
        mid = new_id()
        names[mid] = name
        kind_of[mid] = kind
        return mid

    genres = [entity("genre", g) for g in GENRES]
    professions = [entity("profession", p) for p in PROFESSIONS]
    countries = [entity("country", unique(lambda: place_name() + "ia")) for _ in range(c.countries)]
    cities = [entity("city", unique(place_name)) for _ in range(c.cities)]
    city_country: dict[str, str] = {}
    for i, city in enumerate(cities):
        # The first cities go one per country (so every country has a capital), the rest at random.
        country = countries[i] if i < len(countries) else rng.choice(countries)
        city_country[city] = country
        triples.append((city, CONTAINEDBY, country))
        triples.append((city, POPULATION, str(rng.randrange(20, 4000) * 1000 + rng.randrange(1000))))
        if rng.random() < 0.1:
            aliases[city] = [names[city] + " City"]
    for country in countries:
        capital = next(ci for ci in cities if city_country[ci] == country)
        triples.append((country, CAPITAL, capital))

    people: list[str] = []
    for _ in range(c.people):
        person = entity("person", unique(lambda: rng.choice(_FIRST) + " " + rng.choice(_LAST)))
        people.append(person)
        birth_city = rng.choice(cities)
        triples.append((person, PLACE_OF_BIRTH, birth_city))
        # Most people share their birth city's country (c.nationality_from_birth); the rest draw one at
        # random. The main stream is drawn as at the default 0.8 whatever the share, so a different
        # share changes nationality triples and nothing else; other draws come from `side`.
        u = rng.random()
        drawn = rng.choice(countries) if u >= 0.8 else None
        if u < c.nationality_from_birth:
            nation = city_country[birth_city]
        else:
            nation = drawn if drawn is not None else side.choice(countries)
        triples.append((person, NATIONALITY, nation))
        triples.append((person, DATE_OF_BIRTH, str(rng.randrange(1900, 2000))))
        triples.append((person, PROFESSION, rng.choice(professions)))
        if rng.random() < 0.1:
            first, last = names[person].split(" ", 1)
            aliases[person] = [f"{first[0]}. {last}"]

    singles = list(people)
    rng.shuffle(singles)
    for k in range(min(c.marriages, len(singles) // 2)):
        marriage = new_id()  # a CVT: no name, as in Freebase
        kind_of[marriage] = "marriage"
        a, b = singles[2 * k], singles[2 * k + 1]
        for spouse in (a, b):
            triples.append((spouse, SPOUSE_S, marriage))
            triples.append((marriage, MARRIAGE_SPOUSE, spouse))

    directors = rng.sample(people, c.directors)
    actors = [p for p in people if p not in set(directors)]
    films: list[str] = []
    for k in range(c.films):
        film = entity("film", unique(lambda: f"The {rng.choice(_FILM_ADJ)} {rng.choice(_FILM_NOUN)}"
                                     + (f" {rng.choice(('II', 'III'))}" if rng.random() < 0.3 else "")))
        films.append(film)
        # Every director gets at least two films before the rest are spread at random.
        director = directors[k // 2] if k < 2 * len(directors) else rng.choice(directors)
        triples.append((film, DIRECTED_BY, director))
        triples.append((film, RELEASE_YEAR, str(rng.randrange(1930, 2021))))
        for g in rng.sample(genres, rng.choice((1, 1, 2))):
            triples.append((film, GENRE, g))
        for actor in rng.sample(actors, rng.randrange(2, 5)):
            performance = new_id()
            kind_of[performance] = "performance"
            triples.append((film, STARRING, performance))
            triples.append((performance, PERFORMANCE_ACTOR, actor))

    store = MemoryStore.from_triples(triples, names)
    return SynthKG(store, aliases, kind_of, people, directors, films, cities, countries)


# --- questions ------------------------------------------------------------------------------
def _path(start: list[str], *hops: tuple[str, str] | tuple[str, str, bool]) -> dict[str, Any]:
    return {
        "start": list(start),
        "hops": [{"verb": h[0], "relation": h[1], "exclude_start": bool(h[2]) if len(h) > 2 else False} for h in hops],
    }


def _plan(*paths: dict[str, Any], filt: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"paths": list(paths), "filter": filt}


def _value(store: MemoryStore, entity: str, relation: str) -> int:
    return int(store.tail_entities(entity, relation)[0])


def _candidates(kg: SynthKG, rng: random.Random) -> dict[str, list[tuple[str, str, dict[str, Any], dict[str, str]]]]:
    """Every question the graph supports, per kind: (template, question, plan, topic ids->names)."""
    s = kg.store
    n = s.name
    out: dict[str, list] = {"composition": [], "conjunction": [], "comparative": [], "superlative": []}

    def add(kind: str, template: str, question: str, plan: dict[str, Any], topics: list[str]) -> None:
        out[kind].append((template, question, plan, {t: n(t) or t for t in topics}))

    for film in kg.films:
        f = n(film)
        add("composition", "director_birthplace", f"Where was the director of {f} born?", _plan(_path([film], (TAIL, DIRECTED_BY), (TAIL, PLACE_OF_BIRTH))), [film])
        add("composition", "director_nationality", f"What is the nationality of the director of {f}?", _plan(_path([film], (TAIL, DIRECTED_BY), (TAIL, NATIONALITY))), [film])
        add("composition", "film_actors", f"Which actors star in {f}?", _plan(_path([film], (TAIL, STARRING), (TAIL, PERFORMANCE_ACTOR))), [film])
    for person in kg.people:
        p = n(person)
        add("composition", "birthplace_country", f"Which country contains the place of birth of {p}?", _plan(_path([person], (TAIL, PLACE_OF_BIRTH), (TAIL, CONTAINEDBY))), [person])
        add("composition", "birth_country_capital", f"What is the capital of the country containing the place of birth of {p}?",
            _plan(_path([person], (TAIL, PLACE_OF_BIRTH), (TAIL, CONTAINEDBY), (TAIL, CAPITAL))), [person])
        if s.tail_entities(person, SPOUSE_S):
            add("composition", "spouse", f"Who is the spouse of {p}?", _plan(_path([person], (TAIL, SPOUSE_S), (TAIL, MARRIAGE_SPOUSE, True))), [person])
            add("composition", "spouse_birthplace", f"Where was the spouse of {p} born?",
                _plan(_path([person], (TAIL, SPOUSE_S), (TAIL, MARRIAGE_SPOUSE, True), (TAIL, PLACE_OF_BIRTH))), [person])
        if s.head_entities(person, PERFORMANCE_ACTOR):
            add("composition", "actor_films", f"Which films did {p} star in?", _plan(_path([person], (HEAD, PERFORMANCE_ACTOR), (HEAD, STARRING))), [person])
    for person in kg.directors:
        p = n(person)
        add("composition", "director_genres", f"What are the genres of the films directed by {p}?", _plan(_path([person], (HEAD, DIRECTED_BY), (TAIL, GENRE))), [person])
        films = s.head_entities(person, DIRECTED_BY)
        years = sorted({_value(s, f, RELEASE_YEAR) for f in films})
        year = rng.choice(years)
        add("conjunction", "director_year", f"Which film directed by {p} was released in {year}?",
            _plan(_path([person], (HEAD, DIRECTED_BY)), _path([str(year)], (HEAD, RELEASE_YEAR))), [person, str(year)])
        if len(years) >= 2:
            cut = rng.choice(years[1:])  # at least one film before, at least one not
            add("comparative", "films_before", f"Which films directed by {p} were released before {cut}?",
                _plan(_path([person], (HEAD, DIRECTED_BY)), filt={"verb": TAIL, "relation": RELEASE_YEAR, "op": "lt", "value": str(cut)}), [person])
            cut = rng.choice(years[:-1])
            add("comparative", "films_after", f"Which films directed by {p} were released after {cut}?",
                _plan(_path([person], (HEAD, DIRECTED_BY)), filt={"verb": TAIL, "relation": RELEASE_YEAR, "op": "gt", "value": str(cut)}), [person])
            add("superlative", "first_film", f"Which film directed by {p} was released first?",
                _plan(_path([person], (HEAD, DIRECTED_BY)), filt={"verb": TAIL, "relation": RELEASE_YEAR, "op": "min", "value": None}), [person])
            add("superlative", "latest_film", f"Which film directed by {p} was released most recently?",
                _plan(_path([person], (HEAD, DIRECTED_BY)), filt={"verb": TAIL, "relation": RELEASE_YEAR, "op": "max", "value": None}), [person])
    actor_films: dict[str, list[str]] = {}
    for film in kg.films:
        for performance in s.tail_entities(film, STARRING):
            for actor in s.tail_entities(performance, PERFORMANCE_ACTOR):
                actor_films.setdefault(actor, []).append(film)
    for actor in sorted(actor_films):
        films = actor_films[actor]
        if len(films) >= 2:
            a, b = rng.sample(films, 2)
            add("conjunction", "shared_actor", f"Which actor starred in both {n(a)} and {n(b)}?",
                _plan(_path([a], (TAIL, STARRING), (TAIL, PERFORMANCE_ACTOR)), _path([b], (TAIL, STARRING), (TAIL, PERFORMANCE_ACTOR))), [a, b])
    for city in kg.cities:
        c = n(city)
        born = s.head_entities(city, PLACE_OF_BIRTH)
        if not born:
            continue
        profession = s.tail_entities(rng.choice(born), PROFESSION)[0]
        add("conjunction", "profession_born_in", f"Which {n(profession)} was born in {c}?",
            _plan(_path([city], (HEAD, PLACE_OF_BIRTH)), filt={"verb": TAIL, "relation": PROFESSION, "op": "eq", "value": profession}), [city, profession])
        nation = s.tail_entities(rng.choice(born), NATIONALITY)[0]
        add("conjunction", "nationality_born_in", f"Which person born in {c} has the nationality {n(nation)}?",
            _plan(_path([city], (HEAD, PLACE_OF_BIRTH)), filt={"verb": TAIL, "relation": NATIONALITY, "op": "eq", "value": nation}), [city, nation])
        years = sorted({_value(s, p, DATE_OF_BIRTH) for p in born})
        if len(years) >= 2:
            cut = rng.choice(years[1:])
            add("comparative", "born_before", f"Which people born in {c} were born before {cut}?",
                _plan(_path([city], (HEAD, PLACE_OF_BIRTH)), filt={"verb": TAIL, "relation": DATE_OF_BIRTH, "op": "lt", "value": str(cut)}), [city])
            add("superlative", "oldest_born_in", f"Who is the oldest person born in {c}?",
                _plan(_path([city], (HEAD, PLACE_OF_BIRTH)), filt={"verb": TAIL, "relation": DATE_OF_BIRTH, "op": "min", "value": None}), [city])
            add("superlative", "youngest_born_in", f"Who is the youngest person born in {c}?",
                _plan(_path([city], (HEAD, PLACE_OF_BIRTH)), filt={"verb": TAIL, "relation": DATE_OF_BIRTH, "op": "max", "value": None}), [city])
    for country in kg.countries:
        c = n(country)
        cities = s.head_entities(country, CONTAINEDBY)
        sizes = sorted({_value(s, ci, POPULATION) for ci in cities})
        if len(sizes) >= 2:
            # A round threshold strictly between two populations, so no city sits on it.
            i = rng.randrange(len(sizes) - 1)
            cut = (sizes[i] // 1000 + 1) * 1000 if (sizes[i] // 1000 + 1) * 1000 < sizes[i + 1] else sizes[i] + 1
            add("comparative", "cities_larger", f"Which cities in {c} have a population greater than {cut}?",
                _plan(_path([country], (HEAD, CONTAINEDBY)), filt={"verb": TAIL, "relation": POPULATION, "op": "gt", "value": str(cut)}), [country])
            add("superlative", "largest_city", f"What is the most populous city in {c}?",
                _plan(_path([country], (HEAD, CONTAINEDBY)), filt={"verb": TAIL, "relation": POPULATION, "op": "max", "value": None}), [country])
            add("superlative", "smallest_city", f"What is the least populous city in {c}?",
                _plan(_path([country], (HEAD, CONTAINEDBY)), filt={"verb": TAIL, "relation": POPULATION, "op": "min", "value": None}), [country])
    return out


def _make_task(kg: SynthKG, kind: str, template: str, question: str, plan: dict[str, Any], topics: dict[str, str], max_calls: int,
               max_hops: int = 0) -> Task | None:
    """The task with answers and gold turns from executing the plan; None when the question is
    unfit (no answer, a tie for a superlative, too many calls in a turn, the filter not filtering)."""
    s = kg.store
    turns, answer_ids, triples = run_plan(plan, s)
    if not answer_ids or any(len(t) > max_calls for t in turns) or (max_hops and len(turns) > max_hops):
        return None
    filt = plan.get("filter")
    if filt:
        candidates = len(turns[-1])
        if filt["op"] in ("min", "max"):
            values = [_value(s, call["arguments"]["entity"], filt["relation"]) for call in turns[-1]]
            best = min(values) if filt["op"] == "min" else max(values)
            if values.count(best) > 1:
                return None  # a tie: "the oldest" would have two answers
        elif len(answer_ids) == candidates:
            return None  # the constraint removed nothing: it would not test the comparison
    names = [s.name(a) or a for a in answer_ids]
    aliases = [al for a in answer_ids for al in kg.aliases.get(a, [])]
    return Task(
        id="",
        question=question,
        answers=names,
        aliases=aliases,
        answer_ids=answer_ids,
        topic_entities=topics,
        gold_turns=turns,
        gold_triples=triples,
        kind=kind,
        meta={"plan": plan, "template": template},
    )


def build_tasks(kg: SynthKG, seed: int, total: int, max_calls: int = 6, kinds: tuple[str, ...] = QUESTION_KINDS, max_hops: int = 0,
                templates: tuple[str, ...] = ()) -> list[Task]:
    """Up to `total` distinct questions, kinds in turn (composition, conjunction, comparative,
    superlative, or the subset `kinds`) and templates in turn within a kind, so every kind is
    about equally common. The candidate pools are drawn for every kind whatever `kinds` is, so a
    subset's questions are those the full set would have drawn for its kinds. `templates`
    (non-empty): only those templates' questions, still taken in turn."""
    unknown = sorted(set(kinds) - set(QUESTION_KINDS))
    if unknown or not kinds:
        raise UserError(f"synth: question kinds must be a non-empty subset of {', '.join(QUESTION_KINDS)}; got {', '.join(kinds) or 'none'}")
    rng = random.Random(seed * 7919 + 1)  # a stream apart from the graph's
    pools = _candidates(kg, rng)
    by_template: dict[str, dict[str, list]] = {}
    for kind, items in pools.items():
        rng.shuffle(items)
        for item in items:
            if not templates or item[0] in templates:
                by_template.setdefault(kind, {}).setdefault(item[0], []).append(item)
    queues = {kind: [list(v) for _, v in sorted(pool.items())] for kind, pool in by_template.items()}
    turn_in_kind = {kind: 0 for kind in queues}
    tasks: list[Task] = []
    seen: set[str] = set()
    active = [k for k in QUESTION_KINDS if k in queues and k in kinds]
    while len(tasks) < total and any(any(queues[k]) for k in active):
        for kind in active:
            if len(tasks) >= total:
                break
            open_queues = [q for q in queues[kind] if q]
            while open_queues:
                q = open_queues[turn_in_kind[kind] % len(open_queues)]
                turn_in_kind[kind] += 1
                template, question, plan, topics = q.pop()
                if question in seen:
                    open_queues = [q for q in queues[kind] if q]
                    continue
                task = _make_task(kg, kind, template, question, plan, topics, max_calls, max_hops)
                if task is not None:
                    seen.add(question)
                    tasks.append(task)
                    break
                open_queues = [q for q in queues[kind] if q]
    return tasks


def generate_splits(seed: int = 0, train: int = 1000, dev: int = 100, test: int = 200, config: SynthConfig | None = None) -> tuple[SynthKG, dict[str, list[Task]]]:
    """The graph and its question splits, in memory (what `generate` writes)."""
    c = config or SynthConfig()
    kg = build_kg(seed, c)
    tasks = build_tasks(kg, seed, train + dev + test, c.max_calls_per_turn, tuple(c.kinds), c.max_hops, tuple(c.templates))
    if len(tasks) < train + dev + test:
        raise UserError(f"synth: the graph supports only {len(tasks)} distinct questions, {train + dev + test} asked; enlarge SynthConfig")
    random.Random(seed * 104729 + 2).shuffle(tasks)
    splits = {"train": tasks[:train], "dev": tasks[train : train + dev], "test": tasks[train + dev :]}
    for split, items in splits.items():
        for k, task in enumerate(items):
            task.id = f"synth-s{seed}-{split}-{k:04d}"
    return kg, splits


def generate(out_dir: str | Path, seed: int = 0, train: int = 1000, dev: int = 100, test: int = 200,
             overwrite: bool = False, config: SynthConfig | None = None) -> dict[str, Any]:
    """Write kb.tsv, train/dev/test.jsonl and meta.json into out_dir; returns the meta dict.

    kb.tsv is `head\\trelation\\ttail`, graph triples sorted, then `type.object.name` lines.
    Refuses a non-empty out_dir unless overwrite=True.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"synth: {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"synth: {out} is not empty; pass overwrite=True to write into it")
    kg, splits = generate_splits(seed, train, dev, test, config)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kb.tsv", "w", encoding="utf-8", newline="\n") as f:
        for h, r, t in kg.store.iter_triples():
            f.write(f"{h}\t{r}\t{t}\n")
    for split, tasks in splits.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for task in tasks:
                f.write(json.dumps(task.to_dict(), ensure_ascii=False) + "\n")
    kinds: dict[str, dict[str, int]] = {}
    for split, tasks in splits.items():
        kinds[split] = {}
        for task in tasks:
            kinds[split][task.kind] = kinds[split].get(task.kind, 0) + 1
    meta = {
        "seed": seed,
        "counts": {
            "triples": kg.store.num_triples,
            "entities": len(kg.store.entities()),
            "names": len(kg.store.names),
            **{split: len(tasks) for split, tasks in splits.items()},
        },
        "kinds": kinds,
        "relations": kg.store.relations(),
        "name_relation": NAME_RELATION,
    }
    with open(out / "meta.json", "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta
