"""The Gradio app: it only displays what ``ccr.demo.index.RetrievalIndex`` computes.

Two views, each also an API endpoint (``/search``, ``/caption_ranks``) for ``gradio_client``:
a typed query's top-k images with rank and score, and a dataset caption's ranks in every language
of its image. Fonts are the system's, so the page loads nothing from the internet.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from ccr.demo.index import RetrievalIndex

SEARCH_HEADERS = ["rank", "image", "score"]
RANK_HEADERS = [
    "language",
    "caption",
    "image rank (text->image)",
    "best caption rank (image->text)",
]
SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]
MAX_SLIDER_K = 50


def theme() -> gr.themes.Base:
    """The default theme with local fonts only (the stock one fetches web fonts)."""
    return gr.themes.Default(font=SYSTEM_FONTS, font_mono=["ui-monospace", "monospace"])


def caption_choices(index: RetrievalIndex, language: str) -> list[tuple[str, int]]:
    """(label, caption index) of every caption of ``language``, labelled with its image id."""
    return [
        (f"{index.image_ids[int(index.caption_image[c])]}: {text}", c)
        for c, (text, lang) in enumerate(zip(index.captions, index.caption_language, strict=True))
        if lang == language
    ]


def header(index: RetrievalIndex) -> str:
    lines = [
        f"**{index.checkpoint}**, {index.split} split: {len(index.image_ids)} images, "
        f"{len(index.captions)} captions in {', '.join(index.languages)}.",
        "Ranks are the rank engine's expected 1-based ranks (tied candidates share the mean of "
        "their places), the ones the run's metrics count.",
    ]
    if index.scorer_note:
        lines.append(f"Note: {index.scorer_note}.")
    return "\n\n".join(lines)


def build_app(index: RetrievalIndex, k: int = 10, query: str = "") -> gr.Blocks:
    """The demo's page over ``index``; ``k`` is the initial number of images shown, and a
    non-empty ``query`` is searched as soon as the page opens."""
    largest_k = min(len(index.image_ids), MAX_SLIDER_K)

    def search(text: str, top: float):
        try:
            hits = index.search(text, int(top))
        except ValueError as err:
            raise gr.Error(str(err)) from None
        gallery = [
            (str(hit.path), f"#{hit.rank:g} {hit.image_id} ({hit.score:.4f})") for hit in hits
        ]
        table = [[hit.rank, hit.image_id, hit.score] for hit in hits]
        return gallery, table

    def caption_ranks(caption: int | str | None):
        if caption is None or not str(caption).isdigit():
            raise gr.Error(f"demo: pick a caption (a caption index), got {caption!r}")
        try:
            rows = index.translations(int(caption))
        except ValueError as err:
            raise gr.Error(str(err)) from None
        image = index.image_paths[int(index.caption_image[int(caption)])]
        table = [[row.language, row.text, row.image_rank, row.caption_rank] for row in rows]
        return str(image), table

    def pick_language(language: str):
        return gr.Dropdown(choices=caption_choices(index, language), value=None)

    with gr.Blocks(title="CCR Suite retrieval demo", analytics_enabled=False) as app:
        gr.Markdown(header(index))
        with gr.Tab("Search"):
            query_box = gr.Textbox(
                value=query,
                label=f"Query in any of the model's languages ({', '.join(index.languages)})",
            )
            top = gr.Slider(1, largest_k, value=min(k, largest_k), step=1, label="k")
            go = gr.Button("Search", variant="primary")
            gallery = gr.Gallery(label="Top-k images", columns=5)
            hits = gr.Dataframe(headers=SEARCH_HEADERS, label="Top-k (rank, image, score)")
            go.click(search, [query_box, top], [gallery, hits], api_name="search")
            query_box.submit(search, [query_box, top], [gallery, hits], api_visibility="private")
            if query:
                app.load(search, [query_box, top], [gallery, hits], api_visibility="private")
        with gr.Tab("Caption ranks"):
            language = gr.Dropdown(index.languages, value=index.languages[0], label="Language")
            # custom values: the choices follow the language picked in the page, and an API
            # caller names any caption by index (caption_ranks checks it)
            caption = gr.Dropdown(
                caption_choices(index, index.languages[0]), label="Caption", allow_custom_value=True
            )
            image = gr.Image(label="Its image", type="filepath")
            ranks = gr.Dataframe(
                headers=RANK_HEADERS, label="Its image's captions in every language"
            )
            language.change(pick_language, language, caption, api_visibility="private")
            caption.change(caption_ranks, caption, [image, ranks], api_name="caption_ranks")
    return app


def image_folders(index: RetrievalIndex) -> list[str]:
    """The folders holding the split's images: Gradio serves files only from allowed paths."""
    return sorted({str(Path(path).resolve().parent) for path in index.image_paths})


def launch(app: gr.Blocks, index: RetrievalIndex, host: str, port: int, block: bool = True) -> str:
    """Serve ``app`` on ``host:port``; returns its local URL (``block=False``: in a thread)."""
    _, url, _ = app.launch(
        server_name=host,
        server_port=port,
        prevent_thread_lock=not block,
        allowed_paths=image_folders(index),
        theme=theme(),
        quiet=not block,
        footer_links=[],
        ssr_mode=False,
    )
    return url
