"""Visual question answering on generated scenes, with a zoom tool.

Project-generated (no download, PIL only): each task row is a scene of coloured shapes (circle, square,
triangle, star in six colours, some of them tiny, with grey specks as distractors) drawn from a seed, and one
question about it with an exact short answer (a count, a colour, a shape, yes/no). The scene is shown as an
image in the first user message (`tasks.first_user_message`); the `zoom(x0, y0, x1, y1)` tool returns a region
enlarged from a canvas finer than that image, which is how the tiny shapes can be told apart.

- `environments.visual_scenes.scenes`: the scene description, `generate_scene`, `render_image`, `render_canvas`;
- `environments.visual_scenes.questions`: question types, `answer_query` (answers from the description),
  `tiny_objects_to_zoom` (what needs zooming), `glance_answer` (the answer without zooming);
- `environments.visual_scenes.tasks`: task rows by split (disjoint seed blocks), `SceneImages`;
- `environments.visual_scenes.tools`: the `zoom` tool; `environments.visual_scenes.reward`: `visual_scene_answer`;
- `env_spec(**options)`: the EnvSpec (entry point `visual_scenes`), with oracle / random scripted agents and
  SFT demonstrations (`environments.visual_scenes.spec`).
"""

from environments.visual_scenes.questions import (
    QUESTION_TYPES,
    answer_query,
    glance_answer,
    tiny_objects_to_zoom,
)
from environments.visual_scenes.reward import normalize_answer, visual_scene_answer
from environments.visual_scenes.scenes import COLORS, SHAPES, generate_scene, render_canvas, render_image
from environments.visual_scenes.spec import (
    demonstration,
    env_spec,
    oracle_policy,
    random_policy,
    system_prompt,
)
from environments.visual_scenes.tasks import (
    SceneImages,
    first_user_message,
    generate_split,
    make_row,
    scene_seed,
)
from environments.visual_scenes.tools import ZOOM_SIZE, zoom, zoom_image

__all__ = [
    "COLORS",
    "QUESTION_TYPES",
    "SHAPES",
    "ZOOM_SIZE",
    "SceneImages",
    "answer_query",
    "demonstration",
    "env_spec",
    "first_user_message",
    "generate_scene",
    "generate_split",
    "glance_answer",
    "make_row",
    "normalize_answer",
    "oracle_policy",
    "random_policy",
    "render_canvas",
    "render_image",
    "scene_seed",
    "system_prompt",
    "tiny_objects_to_zoom",
    "visual_scene_answer",
    "zoom",
    "zoom_image",
]
