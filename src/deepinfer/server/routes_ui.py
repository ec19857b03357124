"""The chat page at ``/``: static files shipped inside the package (``server/ui``: HTML, CSS and
plain JavaScript, no build step and nothing fetched from a CDN), talking to the server only
through its OpenAI endpoints. ``deepinfer serve --no-ui`` leaves it out."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).with_name("ui")


def mount_ui(app: FastAPI) -> None:
    """Serve the page at ``/`` and its files under ``/ui``."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(UI_DIR / "index.html", media_type="text/html")

    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")
