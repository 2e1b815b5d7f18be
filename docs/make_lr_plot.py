"""Draw docs/lr-schedule.svg from the real schedule function, without plotting libraries.

    python docs/make_lr_plot.py

Every point is `isotrain.train.schedule.lr_at`, the function the trainer calls once per optimizer
step, so the picture cannot disagree with the code. Settings: 100 steps, 10 warm-up steps,
min_lr_ratio 0.1, learning rate shown as a fraction of the peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from isotrain.train.schedule import lr_at  # noqa: E402

MAX_STEPS, WARMUP_STEPS, MIN_LR_RATIO = 100, 10, 0.1
# (schedule, colour, dash pattern), drawn in this order: the dashed constant curve goes last so it
# stays visible where all three coincide (warm-up).
CURVES = [("linear", "#d95f02", ""), ("cosine", "#7570b3", ""), ("constant", "#1b9e77", "8 4")]
Y_MAX = 1.1  # headroom above the peak, so the constant curve does not sit on the frame
WIDTH, HEIGHT = 640, 360
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 55  # margins around the plot area, in pixels
FONT = 'font-family="sans-serif" font-size="13"'


def x_px(step: float) -> float:
    return LEFT + step / MAX_STEPS * (WIDTH - LEFT - RIGHT)


def y_px(fraction: float) -> float:
    return HEIGHT - BOTTOM - fraction / Y_MAX * (HEIGHT - TOP - BOTTOM)


def axes() -> list[str]:
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{right - LEFT}" height="{bottom - TOP}" fill="none" stroke="#333"/>']
    for step in range(0, MAX_STEPS + 1, 10):
        x = x_px(step)
        parts.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 5}" stroke="#333"/>')
        parts.append(f'<text x="{x:.1f}" y="{bottom + 20}" text-anchor="middle" {FONT}>{step}</text>')
    for tenth in range(0, 11, 2):
        y = y_px(tenth / 10)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end" {FONT}>{tenth / 10:.1f}</text>')
    parts.append(f'<text x="{(LEFT + right) / 2}" y="{HEIGHT - 12}" text-anchor="middle" {FONT}>optimizer step</text>')
    mid_y = (TOP + bottom) / 2
    parts.append(
        f'<text x="18" y="{mid_y}" text-anchor="middle" transform="rotate(-90 18 {mid_y})" {FONT}>lr / train.lr</text>'
    )
    title = f"train.schedule with warmup_steps={WARMUP_STEPS}, max_steps={MAX_STEPS}, min_lr_ratio={MIN_LR_RATIO}"
    parts.append(f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" {FONT} font-weight="bold">{title}</text>')
    return parts


def curve(schedule: str, colour: str, dashes: str) -> str:
    points = []
    for step in range(MAX_STEPS):
        fraction = lr_at(step, lr=1.0, schedule=schedule, warmup_steps=WARMUP_STEPS, max_steps=MAX_STEPS,
                         min_lr_ratio=MIN_LR_RATIO)
        points.append(f"{x_px(step):.1f},{y_px(fraction):.1f}")
    dash = f' stroke-dasharray="{dashes}"' if dashes else ""
    return f'<polyline points="{" ".join(points)}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>'


def legend() -> list[str]:
    x, y = WIDTH - RIGHT - 130, TOP + 90
    parts = [f'<rect x="{x}" y="{y}" width="120" height="76" fill="white" stroke="#999"/>']
    for i, (schedule, colour, dashes) in enumerate(CURVES):
        row_y = y + 20 + 20 * i
        dash = f' stroke-dasharray="{dashes}"' if dashes else ""
        parts.append(f'<line x1="{x + 10}" y1="{row_y}" x2="{x + 40}" y2="{row_y}" stroke="{colour}" '
                     f'stroke-width="2"{dash}/>')
        parts.append(f'<text x="{x + 48}" y="{row_y + 4}" {FONT}>{schedule}</text>')
    return parts


def render() -> str:
    body = [*axes(), *(curve(*spec) for spec in CURVES), *legend()]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">\n'
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


if __name__ == "__main__":
    target = Path(__file__).resolve().parent / "lr-schedule.svg"
    target.write_text(render(), encoding="utf-8")
    print(f"wrote {target}")
