"""The product catalog and shopping goals of the WebShop-compatible environment.

Two sources give the same `Product` / `Goal` records:

- `generate_catalog(seed, num_products)`: a generated catalog (no WebShop data can be had offline here):
  categories with realistic category paths, brands, titles, attributes, option groups (size, color, flavor,
  ...) and prices; `build_goals` writes WebShop-style instructions ("i need a long lasting face moisturizer
  that is paraben free, in 2 ounce, and price lower than 40.00 dollars") whose targets — product type,
  attributes, options and price bound — are exactly the fields the reward checks. Goals are split into
  train and held-out by product, so held-out goals ask for products no train goal names.
- `load_official_catalog(items_path, attributes_path, human_goals_path)`: the official WebShop files
  (`items_shuffle*.json`, `items_ins_v2*.json`, optionally `items_human_ins.json`) when a user has them.

Everything here is a pure function of its arguments (seeded `random.Random`, no global state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Product:
    """One product of the shop.

    asin: the product id shown on result pages and clicked to open the item (10 characters, WebShop style).
    title: the product name. product_type: what kind of product it is ("face moisturizer"), the text
      r_type matches. category: the category path ("Beauty & Personal Care › Skin Care › ...").
    attributes: the product's attributes ("paraben free", "long lasting"), lower case.
    options: option groups in display order, {group: [values]} ({"size": ["1.7 ounce", "2 ounce"]}).
    price: dollars. rating: stars or None. features: bullet points. description: a paragraph.
    reviews: short review texts.
    """

    asin: str
    title: str
    product_type: str
    category: str
    attributes: tuple[str, ...]
    options: Mapping[str, tuple[str, ...]]
    price: float
    rating: float | None = None
    features: tuple[str, ...] = ()
    description: str = ""
    reviews: tuple[str, ...] = ()
    brand: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["options"] = {group: list(values) for group, values in self.options.items()}
        for key in ("attributes", "features", "reviews"):
            data[key] = list(data[key])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Product":
        return cls(
            asin=data["asin"],
            title=data["title"],
            product_type=data["product_type"],
            category=data.get("category", ""),
            attributes=tuple(data.get("attributes", ())),
            options={group: tuple(values) for group, values in dict(data.get("options", {})).items()},
            price=float(data["price"]),
            rating=data.get("rating"),
            features=tuple(data.get("features", ())),
            description=data.get("description", ""),
            reviews=tuple(data.get("reviews", ())),
            brand=data.get("brand", ""),
        )


@dataclasses.dataclass(frozen=True)
class Goal:
    """What a shopper asks for; the reward compares a purchase against these fields.

    instruction: the text shown to the agent. asin: the product the goal was written from (one product that
      satisfies it fully; others may too). product_type / category / title: the type the shopper wants (for
      r_type). attributes: U_att. options: U_opt as {group: value}. price_upper: the price bound u_price.
    """

    goal_id: str
    instruction: str
    asin: str
    product_type: str
    category: str
    title: str
    attributes: tuple[str, ...]
    options: Mapping[str, str]
    price_upper: float

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["attributes"] = list(self.attributes)
        data["options"] = dict(self.options)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Goal":
        missing = [
            k for k in ("instruction", "asin", "attributes", "options", "price_upper") if k not in data
        ]
        if missing:
            raise ValueError(
                f"a WebShop goal needs the fields {missing} (got {sorted(data)}); build goals with "
                "environments.webshop.build_goals or load them with load_official_catalog"
            )
        return cls(
            goal_id=str(data.get("goal_id", data["asin"])),
            instruction=data["instruction"],
            asin=data["asin"],
            product_type=data.get("product_type", ""),
            category=data.get("category", ""),
            title=data.get("title", ""),
            attributes=tuple(data["attributes"]),
            options=dict(data["options"]),
            price_upper=float(data["price_upper"]),
        )


@dataclasses.dataclass(frozen=True)
class Catalog:
    """Products (in a fixed order) and the train / held-out goals written for them."""

    products: tuple[Product, ...]
    train_goals: tuple[Goal, ...]
    heldout_goals: tuple[Goal, ...]
    source: str = "generated"

    def by_asin(self) -> dict[str, Product]:
        return {product.asin: product for product in self.products}


# ----------------------------------------------------------------------------------------------------------
# The generated catalog
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CategorySpec:
    path: str  # category path, WebShop style
    product_type: str  # the type noun phrase
    title_nouns: tuple[str, ...]  # ways titles name the type (first is the type itself)
    descriptors: tuple[str, ...]  # title words that are not attributes
    attributes: tuple[str, ...]  # attribute pool
    options: Mapping[str, tuple[str, ...]]  # option-group pools
    price: tuple[float, float]  # price range in dollars
    brands: tuple[str, ...]


_COLORS = (
    "black",
    "white",
    "navy blue",
    "grey",
    "red",
    "beige",
    "olive green",
    "pink",
    "brown",
    "light blue",
)
_APPAREL_SIZES = ("x-small", "small", "medium", "large", "x-large", "xx-large")

_SPECS: tuple[_CategorySpec, ...] = (
    _CategorySpec(
        "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
        "face moisturizer",
        ("face moisturizer", "facial moisturizing cream", "daily face cream"),
        ("hydrating", "lightweight", "daily", "nourishing", "soothing"),
        (
            "paraben free",
            "cruelty free",
            "long lasting",
            "fragrance free",
            "hyaluronic acid",
            "sensitive skin",
            "non greasy",
            "natural ingredients",
            "dermatologist tested",
        ),
        {
            "size": ("1 ounce", "1.7 ounce", "2 ounce", "3.4 fl oz", "4 fl oz"),
            "scent": ("unscented", "lavender", "rose", "green tea", "citrus"),
        },
        (9.0, 58.0),
        ("Glowline", "Dermaleaf", "PureDay", "Velvessa", "Aquaria"),
    ),
    _CategorySpec(
        "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
        "shampoo",
        ("shampoo", "clarifying shampoo", "volumizing shampoo"),
        ("salon", "gentle", "everyday", "repairing", "moisture"),
        (
            "sulfate free",
            "paraben free",
            "color safe",
            "tea tree",
            "argan oil",
            "dry hair",
            "cruelty free",
            "natural ingredients",
        ),
        {
            "size": ("8 fl oz", "12 fl oz", "16.9 fl oz", "33.8 fl oz"),
            "pack": ("1 count", "2 pack", "3 pack"),
        },
        (6.0, 36.0),
        ("Hairloom", "Maneworks", "Silkora", "Rootwise"),
    ),
    _CategorySpec(
        "Beauty & Personal Care › Makeup › Lips › Lipstick",
        "lipstick",
        ("lipstick", "matte lipstick", "liquid lipstick"),
        ("velvet", "creamy", "bold", "satin", "classic"),
        ("long lasting", "waterproof", "cruelty free", "vegan", "highly pigmented", "non drying"),
        {"color": ("ruby red", "nude", "berry", "coral", "mauve", "deep plum", "pink blush")},
        (5.0, 32.0),
        ("Lumiere", "Kissa", "Colorbloom", "Rougeau"),
    ),
    _CategorySpec(
        "Clothing, Shoes & Jewelry › Women › Clothing › Dresses",
        "women's dress",
        ("women's dress", "women's midi dress", "women's summer dress"),
        ("casual", "floral", "v-neck", "short sleeve", "wrap", "a-line"),
        (
            "machine wash",
            "polyester spandex",
            "elastic waist",
            "button closure",
            "hand wash",
            "loose fit",
            "pockets",
        ),
        {"color": _COLORS, "size": _APPAREL_SIZES},
        (18.0, 79.0),
        ("Amelie", "Sunlace", "Norah & Co", "Veranda"),
    ),
    _CategorySpec(
        "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
        "men's running shoes",
        ("men's running shoes", "men's trail running shoes", "men's athletic sneakers"),
        ("lightweight", "breathable", "cushioned", "road", "performance"),
        ("non slip", "rubber sole", "arch support", "memory foam", "mesh upper", "lace up", "wide toe box"),
        {
            "color": ("black", "white", "grey", "navy blue", "black white", "blue orange"),
            "size": ("7", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12"),
        },
        (29.0, 129.0),
        ("Stridex", "Trailhawk", "Runova", "Pacefield"),
    ),
    _CategorySpec(
        "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts",
        "men's t-shirt",
        ("men's t-shirt", "men's crew neck t-shirt", "men's graphic tee"),
        ("classic", "crew neck", "short sleeve", "vintage", "athletic"),
        ("cotton", "machine wash", "slim fit", "moisture wicking", "tagless", "relaxed fit"),
        {"color": _COLORS, "size": ("small", "medium", "large", "x-large", "xx-large")},
        (9.0, 35.0),
        ("Cotton Row", "Northbay", "Basico", "Urbanthread"),
    ),
    _CategorySpec(
        "Electronics › Headphones, Earbuds & Accessories › Headphones › Over-Ear Headphones",
        "bluetooth headphones",
        ("bluetooth headphones", "wireless over-ear headphones", "bluetooth headset"),
        ("over-ear", "foldable", "hi-fi", "studio", "deep bass"),
        (
            "noise cancelling",
            "long battery life",
            "built-in microphone",
            "fast charging",
            "wireless",
            "memory foam ear cushions",
            "hands free",
        ),
        {"color": ("black", "white", "silver", "rose gold", "midnight blue")},
        (19.0, 199.0),
        ("Sonaro", "Auralite", "Bassline", "Quietway"),
    ),
    _CategorySpec(
        "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
        "phone case",
        ("phone case", "protective phone case", "slim phone cover"),
        ("shockproof", "clear", "rugged", "slim", "magnetic"),
        (
            "wireless charging compatible",
            "drop protection",
            "raised edges",
            "anti scratch",
            "kickstand",
            "easy install",
        ),
        {
            "color": ("clear", "black", "navy blue", "purple", "green"),
            "model": ("iphone 14", "iphone 15", "iphone 15 pro", "galaxy s23", "galaxy s24", "pixel 8"),
        },
        (6.0, 29.0),
        ("Shieldon", "Casewise", "Armorly", "Glasstic"),
    ),
    _CategorySpec(
        "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
        "ground coffee",
        ("ground coffee", "medium roast ground coffee", "dark roast ground coffee"),
        ("rich", "smooth", "bold", "single origin", "house blend"),
        ("usda organic", "fair trade", "100% arabica", "non gmo", "kosher", "low acid"),
        {
            "flavor": ("original", "french vanilla", "hazelnut", "caramel", "mocha"),
            "size": ("12 ounce", "1 pound", "2 pound", "32 ounce"),
        },
        (7.0, 34.0),
        ("Roastfield", "Bean & Barrow", "Morning Ridge", "Cafeterra"),
    ),
    _CategorySpec(
        "Grocery & Gourmet Food › Snack Foods › Bars › Protein Bars",
        "protein bars",
        ("protein bars", "high protein snack bars", "keto protein bars"),
        ("chewy", "crunchy", "snack", "low sugar", "plant based"),
        ("gluten free", "high protein", "low carb", "non gmo", "soy free", "dairy free", "keto friendly"),
        {
            "flavor": (
                "chocolate peanut butter",
                "cookie dough",
                "salted caramel",
                "birthday cake",
                "almond",
            ),
            "pack": ("12 count", "15 count", "24 count"),
        },
        (12.0, 45.0),
        ("Fuelmade", "Barwell", "Proteo", "Nutriforge"),
    ),
    _CategorySpec(
        "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Tea › Green Tea",
        "green tea",
        ("green tea", "green tea bags", "loose leaf green tea"),
        ("premium", "japanese", "jasmine", "matcha blend", "calming"),
        ("usda organic", "caffeine free", "non gmo", "kosher", "gluten free", "individually wrapped"),
        {
            "flavor": ("original", "jasmine", "mint", "lemon ginger", "peach"),
            "size": ("20 count", "40 count", "100 count"),
        },
        (4.0, 26.0),
        ("Leafhaven", "Teazen", "Camellia Grove", "Steepwell"),
    ),
    _CategorySpec(
        "Home & Kitchen › Bedding › Decorative Pillows, Inserts & Covers › Throw Pillow Covers",
        "throw pillow covers",
        ("throw pillow covers", "decorative pillow covers", "cushion covers"),
        ("boho", "farmhouse", "velvet", "linen", "modern"),
        ("set of 2", "hidden zipper", "machine washable", "double sided", "soft", "fade resistant"),
        {
            "color": ("beige", "grey", "navy blue", "mustard yellow", "sage green", "terracotta"),
            "size": ("16 x 16 inch", "18 x 18 inch", "20 x 20 inch", "12 x 20 inch"),
        },
        (8.0, 39.0),
        ("Cozyloft", "Hearthly", "Pillowry", "Linen Lane"),
    ),
    _CategorySpec(
        "Home & Kitchen › Kitchen & Dining › Cookware › Pots & Pans › Cookware Sets",
        "cookware set",
        ("cookware set", "nonstick pots and pans set", "kitchen cookware set"),
        ("10-piece", "12-piece", "professional", "induction", "granite"),
        (
            "nonstick",
            "dishwasher safe",
            "oven safe",
            "pfoa free",
            "induction compatible",
            "stay cool handles",
        ),
        {"color": ("black", "grey", "cream", "blue", "red")},
        (39.0, 249.0),
        ("Panterra", "Cookwell", "Ironhearth", "Kitchora"),
    ),
    _CategorySpec(
        "Tools & Home Improvement › Lighting & Ceiling Fans › Lamps & Shades › Desk Lamps",
        "desk lamp",
        ("desk lamp", "led desk lamp", "architect desk lamp"),
        ("dimmable", "adjustable", "modern", "swing arm", "minimalist"),
        (
            "eye caring",
            "usb charging port",
            "touch control",
            "energy efficient",
            "memory function",
            "flicker free",
        ),
        {"color": ("black", "white", "silver", "gold")},
        (15.0, 69.0),
        ("Lumora", "Brightwork", "Deskglow", "Halden"),
    ),
    _CategorySpec(
        "Pet Supplies › Dogs › Food › Dry",
        "dry dog food",
        ("dry dog food", "grain free dog food", "adult dry dog food"),
        ("natural", "high protein", "small breed", "adult", "recipe"),
        (
            "grain free",
            "real meat",
            "no artificial preservatives",
            "high protein",
            "made in usa",
            "omega fatty acids",
        ),
        {
            "flavor": ("chicken", "salmon", "lamb", "beef", "turkey"),
            "size": ("4 pound", "15 pound", "30 pound"),
        },
        (14.0, 89.0),
        ("Pawprime", "Barkfield", "Wildkin", "Houndly"),
    ),
    _CategorySpec(
        "Sports & Outdoors › Exercise & Fitness › Yoga › Mats",
        "yoga mat",
        ("yoga mat", "non slip exercise mat", "thick yoga mat"),
        ("extra thick", "eco", "travel", "premium", "pilates"),
        ("non slip", "eco friendly", "carrying strap", "tpe", "latex free", "easy to clean"),
        {
            "color": ("purple", "black", "teal", "pink", "grey", "blue"),
            "thickness": ("1/4 inch", "1/3 inch", "1/2 inch"),
        },
        (12.0, 59.0),
        ("Zenflex", "Asanara", "Flowmat", "Groundwell"),
    ),
    _CategorySpec(
        "Office Products › Office Furniture & Lighting › Chairs & Sofas › Desk Chairs",
        "office chair",
        ("office chair", "ergonomic desk chair", "mesh office chair"),
        ("ergonomic", "high back", "executive", "swivel", "home office"),
        (
            "lumbar support",
            "adjustable height",
            "breathable mesh",
            "padded armrests",
            "easy assembly",
            "360 degree swivel",
        ),
        {"color": ("black", "grey", "white", "blue")},
        (59.0, 299.0),
        ("Sitwell", "Officio", "Postura", "Deskmate"),
    ),
    _CategorySpec(
        "Sports & Outdoors › Outdoor Recreation › Camping & Hiking › Hydration & Filtration › Water Bottles",
        "water bottle",
        ("water bottle", "insulated water bottle", "stainless steel water bottle"),
        ("sports", "vacuum", "wide mouth", "leakproof", "double wall"),
        ("bpa free", "stainless steel", "keeps cold 24 hours", "dishwasher safe", "leak proof", "straw lid"),
        {
            "color": ("black", "white", "sage green", "ocean blue", "lilac"),
            "size": ("18 ounce", "24 ounce", "32 ounce", "40 ounce"),
        },
        (9.0, 45.0),
        ("Hydrana", "Coldcore", "Trekflask", "Sipwell"),
    ),
    _CategorySpec(
        "Clothing, Shoes & Jewelry › Luggage & Travel Gear › Backpacks › Laptop Backpacks",
        "laptop backpack",
        ("laptop backpack", "travel laptop backpack", "anti theft backpack"),
        ("slim", "business", "college", "water resistant", "large capacity"),
        (
            "usb charging port",
            "fits 15.6 inch laptop",
            "water resistant",
            "anti theft pocket",
            "padded shoulder straps",
            "luggage strap",
        ),
        {"color": ("black", "grey", "navy blue", "khaki", "dark green")},
        (19.0, 89.0),
        ("Packton", "Roamwell", "Carryall Co", "Urbanpack"),
    ),
)

_FEATURE_TEMPLATES = (
    "{Attr}: made to be {attr}, so it fits right into your routine.",
    "{Attr} - one of the reasons customers choose this {type}.",
    "Designed with {attr} in mind for everyday use.",
)
_REVIEW_TEMPLATES = (
    "Exactly as described. The {attr} part really shows.",
    "Good value for the price; I would buy this {type} again.",
    "Arrived quickly. Not perfect but does the job.",
    "My second purchase from {brand}. Love it.",
)


def _asin(rng: random.Random, taken: set[str]) -> str:
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _nice_price(value: float) -> float:
    """A shop price: dollars ending in .99, .49 or .00."""
    return round(max(1.0, math.floor(value)) + random.Random(int(value * 1000)).choice((0.99, 0.49, 0.0)), 2)


def _capitalize(text: str) -> str:
    """Each word capitalised as listings do: "women's dress" -> "Women's Dress" (str.title: "Women'S")."""
    return " ".join(word[:1].upper() + word[1:] for word in text.split())


def _make_product(spec: _CategorySpec, rng: random.Random, taken: set[str]) -> Product:
    brand = rng.choice(spec.brands)
    noun = rng.choice(spec.title_nouns)
    attributes = tuple(sorted(rng.sample(spec.attributes, rng.randint(2, min(5, len(spec.attributes))))))
    # 1 or all option groups; each group offers 2..6 of its pool's values (in pool order, as shops list them).
    groups = list(spec.options)
    groups = groups if len(groups) == 1 or rng.random() < 0.7 else [rng.choice(groups)]
    options = {}
    for group in groups:
        pool = spec.options[group]
        chosen = set(rng.sample(pool, rng.randint(min(2, len(pool)), min(6, len(pool)))))
        options[group] = tuple(value for value in pool if value in chosen)
    descriptors = rng.sample(spec.descriptors, 2)
    shown = rng.sample(attributes, min(2, len(attributes)))  # titles name some attributes, as listings do
    named = ", ".join(_capitalize(a) for a in shown)
    title = f"{brand} {_capitalize(descriptors[0])} {_capitalize(noun)}, {named}"
    if rng.random() < 0.5 and descriptors[1] not in shown:
        title += f" - {_capitalize(descriptors[1])}"
    price = _nice_price(rng.uniform(*spec.price))
    features = tuple(
        rng.choice(_FEATURE_TEMPLATES).format(Attr=attr.upper(), attr=attr, type=spec.product_type)
        for attr in attributes
    )
    description = (
        f"The {brand} {noun} is a {descriptors[0]} {spec.product_type} that is "
        f"{', '.join(attributes[:-1]) + ' and ' + attributes[-1] if len(attributes) > 1 else attributes[0]}. "
        f"Available in {'; '.join(g + ': ' + ', '.join(v) for g, v in options.items())}."
    )
    reviews = tuple(
        rng.choice(_REVIEW_TEMPLATES).format(attr=rng.choice(attributes), type=spec.product_type, brand=brand)
        for _ in range(rng.randint(1, 3))
    )
    return Product(
        asin=_asin(rng, taken),
        title=title,
        product_type=spec.product_type,
        category=spec.path,
        attributes=attributes,
        options=options,
        price=price,
        rating=round(rng.uniform(3.0, 5.0), 1) if rng.random() < 0.85 else None,
        features=features,
        description=description,
        reviews=reviews,
        brand=brand,
    )


def generate_products(seed: int = 0, num_products: int = 1000) -> tuple[Product, ...]:
    """`num_products` products spread evenly over the categories, in a seeded shuffled order."""
    if num_products < len(_SPECS):
        raise ValueError(f"num_products={num_products}; the generated catalog needs at least {len(_SPECS)}")
    rng = random.Random(f"webshop-catalog-{seed}")
    taken: set[str] = set()
    products = [_make_product(_SPECS[i % len(_SPECS)], rng, taken) for i in range(num_products)]
    rng.shuffle(products)
    return tuple(products)


def _price_upper(price: float, rng: random.Random) -> float:
    """A shopper's budget above `price`: a round number 10-80% higher (WebShop goals use such bounds)."""
    bound = price * rng.uniform(1.1, 1.8)
    step = 10.0 if bound >= 50 else 5.0 if bound >= 10 else 1.0
    return float(math.ceil(bound / step) * step)


def _instruction(
    product_type: str,
    attributes: Sequence[str],
    options: Mapping[str, str],
    price_upper: float,
    rng: random.Random,
) -> str:
    opener = rng.choice(("i need", "i'm looking for", "i want to buy", "find me", "i am looking for"))
    plural = product_type.endswith("s") and not product_type.endswith("ss")
    article = "" if plural else ("an " if product_type[0] in "aeiou" else "a ")
    lead, rest = (attributes[0], attributes[1:]) if attributes and rng.random() < 0.5 else ("", attributes)
    text = f"{opener} {article}{lead + ' ' if lead else ''}{product_type}"
    if rest:
        text += " that is " + (
            " and ".join(rest) if len(rest) < 3 else ", ".join(rest[:-1]) + " and " + rest[-1]
        )
    if options:
        parts = [
            f"{value} {group}" if group in ("flavor", "color", "scent") else f"{group} {value}"
            for group, value in options.items()
        ]
        text += ", with " + " and ".join(parts)
    return f"{text}, and price lower than {price_upper:.2f} dollars"


def _goal_for(product: Product, rng: random.Random, goal_id: str) -> Goal:
    attributes = tuple(rng.sample(product.attributes, rng.randint(1, min(3, len(product.attributes)))))
    options = {group: rng.choice(values) for group, values in product.options.items()}
    price_upper = _price_upper(product.price, rng)
    return Goal(
        goal_id=goal_id,
        instruction=_instruction(product.product_type, attributes, options, price_upper, rng),
        asin=product.asin,
        product_type=product.product_type,
        category=product.category,
        title=product.title,
        attributes=attributes,
        options=options,
        price_upper=price_upper,
    )


def is_heldout(asin: str, heldout_fraction: float) -> bool:
    """Whether goals written for this product belong to the held-out split (a stable hash of the asin)."""
    digest = int(hashlib.sha256(asin.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < heldout_fraction


def build_goals(
    products: Sequence[Product], seed: int = 0, goals_per_product: int = 1, heldout_fraction: float = 0.1
) -> tuple[tuple[Goal, ...], tuple[Goal, ...]]:
    """(train goals, held-out goals): `goals_per_product` goals per product, split by product."""
    rng = random.Random(f"webshop-goals-{seed}")
    train, heldout = [], []
    for product in products:
        for k in range(goals_per_product):
            goal = _goal_for(product, rng, goal_id=f"{product.asin}-{k}")
            (heldout if is_heldout(product.asin, heldout_fraction) else train).append(goal)
    return tuple(train), tuple(heldout)


def generate_catalog(
    seed: int = 0, num_products: int = 1000, goals_per_product: int = 1, heldout_fraction: float = 0.1
) -> Catalog:
    """The generated catalog with its train and held-out goals."""
    products = generate_products(seed, num_products)
    train, heldout = build_goals(products, seed, goals_per_product, heldout_fraction)
    return Catalog(products, train, heldout, source=f"generated(seed={seed}, num_products={num_products})")


# ----------------------------------------------------------------------------------------------------------
# The official WebShop files
# ----------------------------------------------------------------------------------------------------------

_PRICE = re.compile(r"\$?\s*([0-9][0-9,]*\.?[0-9]*)")


def parse_price(value: Any) -> float | None:
    """A price in dollars from a number, "$12.99", "$10.00 - $15.00" (the lower end) or a list of those."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        prices = [p for p in (parse_price(v) for v in value) if p is not None]
        return min(prices) if prices else None
    if isinstance(value, str):
        found = [float(m.replace(",", "")) for m in _PRICE.findall(value) if m.replace(",", "").strip(".")]
        return min(found) if found else None
    return None


def _official_options(raw: Any) -> dict[str, tuple[str, ...]]:
    options = {}
    for group, values in dict(raw or {}).items():
        names = [v.get("value") if isinstance(v, Mapping) else v for v in values or ()]
        names = tuple(str(n).strip().lower() for n in names if n is not None and str(n).strip())
        if names:
            options[str(group).strip().lower()] = names
    return options


def _official_product(item: Mapping[str, Any], attributes: Iterable[str]) -> Product | None:
    asin = item.get("asin")
    title = item.get("name") or item.get("Title") or item.get("title")
    price = parse_price(item.get("pricing", item.get("list_price", item.get("price"))))
    if not asin or not title or price is None:
        return None
    features = item.get("small_description") or item.get("BulletPoints") or ()
    if isinstance(features, str):
        features = [features]
    rating = item.get("average_rating", item.get("Rating"))
    try:
        rating = float(str(rating).split()[0]) if rating not in (None, "", "N.A.") else None
    except ValueError:
        rating = None
    reviews = tuple(
        (r.get("body") or r.get("review") or "") if isinstance(r, Mapping) else str(r)
        for r in item.get("Reviews", item.get("reviews", ())) or ()
    )
    return Product(
        asin=str(asin),
        title=str(title).strip(),
        product_type=str(item.get("query") or item.get("category") or "").strip().lower(),
        category=str(item.get("product_category") or item.get("category") or "").strip(),
        attributes=tuple(sorted({str(a).strip().lower() for a in attributes if str(a).strip()})),
        options=_official_options(item.get("customization_options")),
        price=price,
        rating=rating,
        features=tuple(str(f) for f in features),
        description=str(item.get("full_description") or item.get("Description") or ""),
        reviews=tuple(r for r in reviews if r),
    )


def _official_goal(product: Product, spec: Mapping[str, Any], index: int, rng: random.Random) -> Goal | None:
    instruction = spec.get("instruction")
    if not instruction:
        return None
    options = spec.get("instruction_options") or {}
    if isinstance(options, (list, tuple)):  # a list of values: match them against the product's groups
        values = [str(v).strip().lower() for v in options]
        options = {}
        for value in values:
            group = next(
                (g for g, vs in product.options.items() if value in vs), f"option {len(options) + 1}"
            )
            options[group] = value
    options = {str(g).strip().lower(): str(v).strip().lower() for g, v in dict(options).items()}
    price_upper = spec.get("price_upper") or _price_upper(product.price, rng)
    text = str(instruction).strip()
    if "price lower than" not in text.lower():
        text = f"{text.rstrip('.')}, and price lower than {float(price_upper):.2f} dollars"
    return Goal(
        goal_id=f"{product.asin}-{index}",
        instruction=text,
        asin=product.asin,
        product_type=product.product_type,
        category=product.category,
        title=product.title,
        attributes=tuple(str(a).strip().lower() for a in spec.get("instruction_attributes") or ()),
        options=options,
        price_upper=float(price_upper),
    )


def load_official_catalog(
    items_path: str | Path,
    attributes_path: str | Path,
    human_goals_path: str | Path | None = None,
    *,
    seed: int = 0,
    heldout_fraction: float = 0.1,
) -> Catalog:
    """The catalog and goals from the official WebShop files.

    items_path: `items_shuffle_1000.json` / `items_shuffle.json`: a list of products with `asin`, `name`,
      `query` (used as the product type), `product_category`, `pricing`, `customization_options`
      ({group: [{"value": ...}, ...]}), `small_description`, `full_description`, `Reviews`, ...
    attributes_path: `items_ins_v2_1000.json` / `items_ins_v2.json`: {asin: {"attributes": [...],
      "instruction": ..., "instruction_attributes": [...], "instruction_options": ...}}.
    human_goals_path: `items_human_ins.json` ({asin: [{"instruction", "instruction_attributes",
      "instruction_options"}, ...]}); when given, goals come from it, else from the synthetic instructions
      of `attributes_path`. Goals without a price bound get one 10-80% above the product's price.
    Products without an asin, a name or a parsable price are skipped (their count is in `Catalog.source`).
    """
    for label, path in (
        ("items_path", items_path),
        ("attributes_path", attributes_path),
        ("human_goals_path", human_goals_path),
    ):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(
                f"WebShop {label} {str(path)!r} does not exist; point the webshop catalog config at the "
                "official items_shuffle*.json / items_ins_v2*.json / items_human_ins.json files"
            )
    items = json.loads(Path(items_path).read_text())
    attribute_specs = json.loads(Path(attributes_path).read_text())
    if not isinstance(items, list) or not isinstance(attribute_specs, dict):
        raise ValueError(
            f"{items_path} should hold a JSON list of products and {attributes_path} a JSON object keyed "
            "by asin"
        )
    products, skipped = [], 0
    for item in items:
        spec = attribute_specs.get(item.get("asin"), {})
        product = _official_product(item, spec.get("attributes", ()))
        if product is None:
            skipped += 1
            continue
        products.append(product)
    by_asin = {p.asin: p for p in products}
    goal_specs: dict[str, list[Mapping[str, Any]]] = {}
    if human_goals_path is not None:
        for asin, specs in json.loads(Path(human_goals_path).read_text()).items():
            goal_specs[asin] = list(specs) if isinstance(specs, list) else [specs]
    else:
        goal_specs = {asin: [spec] for asin, spec in attribute_specs.items() if spec.get("instruction")}
    rng = random.Random(f"webshop-official-goals-{seed}")
    train, heldout = [], []
    for asin in sorted(goal_specs):
        product = by_asin.get(asin)
        if product is None:
            continue
        for index, spec in enumerate(goal_specs[asin]):
            goal = _official_goal(product, spec, index, rng)
            if goal is not None:
                (heldout if is_heldout(asin, heldout_fraction) else train).append(goal)
    source = f"official({Path(items_path).name}, {len(products)} products, {skipped} skipped)"
    return Catalog(tuple(products), tuple(train), tuple(heldout), source=source)
