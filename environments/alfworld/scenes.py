"""Household scenes and goals for ALFWorld's PDDL domain, sampled from a seed (pure functions, no engine).

A scene is a room of one kind (kitchen, living room, bedroom, bathroom) with receptacles (counter tops,
cabinets, a fridge, ...) at their own locations and objects inside them. A goal is one of ALFWorld's six
task types over the scene's object and receptacle types. `problem_pddl` writes the PDDL problem for the
package's `alfred.pddl` domain; names follow ALFWorld's convention (`Apple_bar_1`) so that its demangler
shows them as "apple 1".
"""

from __future__ import annotations

import dataclasses
import random

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

# Receptacle types per room kind: (type, openable, how many at most).
ROOMS: dict[str, tuple[tuple[str, bool, int], ...]] = {
    "kitchen": (("CounterTop", False, 2), ("Cabinet", True, 4), ("Drawer", True, 3), ("Fridge", True, 1),
                ("Microwave", True, 1), ("SinkBasin", False, 1), ("StoveBurner", False, 2),
                ("DiningTable", False, 1), ("Shelf", False, 2), ("GarbageCan", False, 1)),
    "livingroom": (("Sofa", False, 1), ("ArmChair", False, 1), ("CoffeeTable", False, 1), ("SideTable", False, 2),
                   ("Drawer", True, 3), ("Cabinet", True, 2), ("Shelf", False, 3), ("TVStand", False, 1),
                   ("GarbageCan", False, 1)),
    "bedroom": (("Bed", False, 1), ("Desk", False, 1), ("Drawer", True, 4), ("Dresser", False, 1),
                ("Shelf", False, 3), ("SideTable", False, 2), ("GarbageCan", False, 1), ("Safe", True, 1)),
    "bathroom": (("CounterTop", False, 1), ("SinkBasin", False, 2), ("Cabinet", True, 3), ("Drawer", True, 2),
                 ("Toilet", False, 1), ("TowelHolder", False, 1), ("Shelf", False, 2), ("GarbageCan", False, 1)),
}


@dataclasses.dataclass(frozen=True)
class ObjectKind:
    """An object type: where it can be (receptacle types, any room), and what can be done to it."""

    name: str
    receptacles: tuple[str, ...]
    cleanable: bool = False
    heatable: bool = False
    coolable: bool = False


_FOOD = ("CounterTop", "DiningTable", "Fridge", "Microwave", "SinkBasin", "GarbageCan", "Shelf")
_DISH = ("CounterTop", "DiningTable", "Cabinet", "Shelf", "SinkBasin", "Microwave", "Fridge", "Drawer")
_UTENSIL = ("CounterTop", "DiningTable", "Drawer", "SinkBasin", "Cabinet")
_SMALL = ("SideTable", "Desk", "Dresser", "Drawer", "Shelf", "CoffeeTable", "Sofa", "ArmChair", "Bed", "TVStand",
          "Safe", "Cabinet", "GarbageCan")
_BATH = ("CounterTop", "Cabinet", "Drawer", "Shelf", "Toilet", "SinkBasin", "GarbageCan", "TowelHolder")

OBJECTS: tuple[ObjectKind, ...] = (
    ObjectKind("Apple", _FOOD, cleanable=True, heatable=True, coolable=True),
    ObjectKind("Tomato", _FOOD, cleanable=True, heatable=True, coolable=True),
    ObjectKind("Potato", _FOOD, cleanable=True, heatable=True, coolable=True),
    ObjectKind("Egg", _FOOD, heatable=True, coolable=True),
    ObjectKind("Bread", _FOOD, heatable=True, coolable=True),
    ObjectKind("Lettuce", _FOOD, cleanable=True, coolable=True),
    ObjectKind("Mug", _DISH + ("CoffeeMachine",), cleanable=True, heatable=True, coolable=True),
    ObjectKind("Cup", _DISH, cleanable=True, heatable=True, coolable=True),
    ObjectKind("Bowl", _DISH, cleanable=True, heatable=True, coolable=True),
    ObjectKind("Plate", _DISH, cleanable=True, heatable=True, coolable=True),
    ObjectKind("Pan", _DISH + ("StoveBurner",), cleanable=True, coolable=True),
    ObjectKind("Pot", _DISH + ("StoveBurner",), cleanable=True, coolable=True),
    ObjectKind("Knife", _UTENSIL, cleanable=True),
    ObjectKind("Fork", _UTENSIL, cleanable=True),
    ObjectKind("Spoon", _UTENSIL, cleanable=True),
    ObjectKind("Spatula", _UTENSIL, cleanable=True),
    ObjectKind("Ladle", _UTENSIL, cleanable=True),
    ObjectKind("Book", _SMALL),
    ObjectKind("CellPhone", _SMALL),
    ObjectKind("KeyChain", _SMALL),
    ObjectKind("Pen", _SMALL),
    ObjectKind("Pencil", _SMALL),
    ObjectKind("CreditCard", _SMALL),
    ObjectKind("RemoteControl", _SMALL),
    ObjectKind("Watch", _SMALL),
    ObjectKind("Vase", _SMALL),
    ObjectKind("Statue", _SMALL),
    ObjectKind("AlarmClock", _SMALL),
    ObjectKind("Pillow", ("Sofa", "ArmChair", "Bed")),
    ObjectKind("Laptop", ("Desk", "Bed", "Sofa", "CoffeeTable", "SideTable")),
    ObjectKind("SoapBar", _BATH, cleanable=True),
    ObjectKind("Cloth", _BATH, cleanable=True),
    ObjectKind("SprayBottle", _BATH),
    ObjectKind("ToiletPaper", _BATH),
    ObjectKind("Candle", _BATH + ("SideTable", "Shelf")),
    ObjectKind("SoapBottle", _BATH),
)
OBJECT_KINDS = {kind.name: kind for kind in OBJECTS}
LAMP = "DeskLamp"
LAMP_RECEPTACLES = ("Desk", "SideTable", "Dresser")

# Which rooms can host which task type (the appliance the task needs must be there).
TASK_ROOMS = {
    "pick_and_place_simple": ("kitchen", "livingroom", "bedroom", "bathroom"),
    "look_at_obj_in_light": ("livingroom", "bedroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
    "pick_two_obj_and_place": ("kitchen", "livingroom", "bedroom", "bathroom"),
}


@dataclasses.dataclass
class Scene:
    """A sampled room: receptacles (name -> type), their openability, and objects (name -> receptacle)."""

    room: str
    receptacles: dict[str, str]
    openable: set[str]
    objects: dict[str, str]  # object name -> receptacle name it is in
    object_types: dict[str, str]

    def receptacle_types(self) -> set[str]:
        return set(self.receptacles.values())


@dataclasses.dataclass(frozen=True)
class Goal:
    """An ALFWorld goal: task type, target object type, target receptacle type (and the lamp for light tasks)."""

    task_type: str
    object_type: str
    receptacle_type: str  # "" for look_at_obj_in_light
    toggle_type: str = ""


def _name(kind: str, index: int) -> str:
    # ALFWorld's demangler appends "basin" to names of ids that mention one: "Sink_bar_1_bar_SinkBasin" is shown
    # as "sinkbasin 1", like in the official games.
    if kind.endswith("Basin"):
        return f"{kind[:-len('Basin')]}_bar_{index}_bar_{kind}"
    return f"{kind}_bar_{index}"


def sample_scene(room: str, rng: random.Random) -> Scene:
    """A room of kind `room`: 60-100% of its receptacle slots, then 6-12 objects placed where they fit."""
    receptacles, openable = {}, set()
    for kind, can_open, most in ROOMS[room]:
        count = rng.randint(1, most) if rng.random() < 0.8 or kind in ("Microwave", "Fridge", "SinkBasin") else 0
        for i in range(1, count + 1):
            name = _name(kind, i)
            receptacles[name] = kind
            if can_open:
                openable.add(name)
    present = set(receptacles.values())
    fitting = [k for k in OBJECTS if set(k.receptacles) & present]
    objects, object_types = {}, {}
    counts: dict[str, int] = {}
    for _ in range(rng.randint(6, 12)):
        kind = rng.choice(fitting)
        places = [r for r, t in receptacles.items() if t in kind.receptacles]
        counts[kind.name] = counts.get(kind.name, 0) + 1
        name = _name(kind.name, counts[kind.name])
        objects[name] = rng.choice(places)
        object_types[name] = kind.name
    return Scene(room, receptacles, openable, objects, object_types)


def _can_hold(receptacle_type: str, kind: ObjectKind) -> bool:
    return receptacle_type in kind.receptacles


def sample_goal(task_type: str, scene: Scene, rng: random.Random) -> Goal | None:
    """A goal of `task_type` the scene can host (adding the objects it needs), or None if it cannot."""
    present = scene.receptacle_types()
    needs = {"pick_clean_then_place_in_recep": ("SinkBasin", "cleanable"),
             "pick_heat_then_place_in_recep": ("Microwave", "heatable"),
             "pick_cool_then_place_in_recep": ("Fridge", "coolable")}
    if task_type in needs:
        appliance, ability = needs[task_type]
        if appliance not in present:
            return None
        kinds = [k for k in OBJECTS if getattr(k, ability) and set(k.receptacles) & (present - {appliance})]
    else:
        kinds = [k for k in OBJECTS if set(k.receptacles) & present]
    if task_type == "look_at_obj_in_light":
        lamp_places = [r for r, t in scene.receptacles.items() if t in LAMP_RECEPTACLES]
        if not lamp_places:
            return None
        kinds = [k for k in kinds if k.name not in ("Pillow",)]
        if not kinds:
            return None
        kind = rng.choice(kinds)
        _ensure_objects(scene, kind, 1, rng)
        lamp = _name(LAMP, 1)
        scene.objects[lamp] = rng.choice(lamp_places)
        scene.object_types[lamp] = LAMP
        return Goal(task_type, kind.name, "", LAMP)
    rng.shuffle(kinds)
    for kind in kinds:
        targets = sorted({t for t in present if _can_hold(t, kind)} - {"Microwave", "Fridge", "SinkBasin"}
                         if task_type in needs else {t for t in present if _can_hold(t, kind)})
        if not targets:
            continue
        target = rng.choice(targets)
        wanted = 2 if task_type == "pick_two_obj_and_place" else 1
        _ensure_objects(scene, kind, wanted, rng, avoid_type=target)
        return Goal(task_type, kind.name, target)
    return None


def _ensure_objects(scene: Scene, kind: ObjectKind, count: int, rng: random.Random, avoid_type: str = "") -> None:
    """Makes sure at least `count` objects of `kind` exist outside receptacles of type `avoid_type`."""
    def outside():
        return [o for o, t in scene.object_types.items()
                if t == kind.name and scene.receptacles[scene.objects[o]] != avoid_type]

    places = [r for r, t in scene.receptacles.items() if t in kind.receptacles and t != avoid_type]
    if not places:
        places = [r for r, t in scene.receptacles.items() if t in kind.receptacles]
    index = sum(1 for t in scene.object_types.values() if t == kind.name)
    while len(outside()) < count:
        index += 1
        name = _name(kind.name, index)
        scene.objects[name] = rng.choice(places)
        scene.object_types[name] = kind.name
    # Objects of the kind already in a target receptacle would make the goal trivially (half) done.
    for name in [o for o, t in scene.object_types.items() if t == kind.name and o not in outside()]:
        scene.objects[name] = rng.choice(places)


def goal_pddl(goal: Goal) -> str:
    """The PDDL goal of `goal` over the domain's predicates."""
    ot, rt = f"{goal.object_type}Type", f"{goal.receptacle_type}Type"
    if goal.task_type == "pick_two_obj_and_place":
        return (f"(exists (?r - receptacle ?o1 - object ?o2 - object) (and (receptacleType ?r {rt}) "
                f"(objectType ?o1 {ot}) (objectType ?o2 {ot}) (not (= ?o1 ?o2)) (inReceptacle ?o1 ?r) "
                f"(inReceptacle ?o2 ?r)))")
    if goal.task_type == "look_at_obj_in_light":
        return (f"(exists (?o - object ?t - object ?l - location) (and (objectType ?o {ot}) (holds agent1 ?o) "
                f"(objectType ?t {goal.toggle_type}Type) (isToggled ?t) (atLocation agent1 ?l) "
                f"(objectAtLocation ?t ?l)))")
    state = {"pick_clean_then_place_in_recep": " (isClean ?o)", "pick_heat_then_place_in_recep": " (isHot ?o)",
             "pick_cool_then_place_in_recep": " (isCool ?o)"}.get(goal.task_type, "")
    return (f"(exists (?r - receptacle ?o - object) (and (receptacleType ?r {rt}) (objectType ?o {ot}) "
            f"(inReceptacle ?o ?r){state}))")


def problem_pddl(scene: Scene, goal: Goal, name: str) -> str:
    """The PDDL problem: the scene's objects, locations and facts, and the goal."""
    locations = {r: f"loc_bar_{i}" for i, r in enumerate(sorted(scene.receptacles), start=1)}
    object_kinds = sorted(set(scene.object_types.values()))
    receptacle_kinds = sorted(scene.receptacle_types() | {"SinkBasin", "Microwave", "Fridge"})
    lines = ["agent1 - agent", "loc_bar_0 - location"]
    lines += [f"{loc} - location" for loc in sorted(locations.values())]
    lines += [f"{kind}Type - otype" for kind in sorted(set(object_kinds) | {goal.object_type, LAMP})]
    lines += [f"{kind}Type - rtype" for kind in receptacle_kinds]
    lines += [f"{r} - receptacle" for r in sorted(scene.receptacles)]
    lines += [f"{o} - object" for o in sorted(scene.objects)]
    init = ["(atLocation agent1 loc_bar_0)"]
    for r, kind in sorted(scene.receptacles.items()):
        init += [f"(receptacleAtLocation {r} {locations[r]})", f"(receptacleType {r} {kind}Type)"]
        if r in scene.openable:
            init.append(f"(openable {r})")
    for kind in object_kinds:
        if kind == LAMP:
            continue
        for rt in sorted(scene.receptacle_types()):
            if rt in OBJECT_KINDS[kind].receptacles:
                init.append(f"(canContain {rt}Type {kind}Type)")
    for o, r in sorted(scene.objects.items()):
        kind = scene.object_types[o]
        init += [f"(inReceptacle {o} {r})", f"(objectAtLocation {o} {locations[r]})", f"(objectType {o} {kind}Type)"]
        if kind == LAMP:
            init.append(f"(toggleable {o})")
            continue
        spec = OBJECT_KINDS[kind]
        init.append(f"(pickupable {o})")
        init += [f"({ability} {o})" for ability in ("cleanable", "heatable", "coolable") if getattr(spec, ability)]
    body = "\n    ".join(lines)
    facts = "\n    ".join(init)
    return (f"(define (problem {name})\n  (:domain alfred)\n  (:objects\n    {body}\n  )\n  (:init\n    {facts}\n  )\n"
            f"  (:goal\n    {goal_pddl(goal)}\n  )\n)\n")


def task_description(goal: Goal, rng: random.Random) -> str:
    """ALFWorld's templated goal text for `goal` (templates from the package's goal library)."""
    from alfworld.gen import goal_library

    template = rng.choice(goal_library.gdict[goal.task_type]["templates"])
    return template.format(obj=goal.object_type.lower(), recep=goal.receptacle_type.lower(),
                           toggle=goal.toggle_type.lower(), mrecep="")
