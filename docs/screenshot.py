"""Draw README's screenshot (docs/screenshot.svg): the main screen after two turns with
the demo model, in a throwaway home, through the real app under Textual's pilot.

    .venv/bin/python docs/screenshot.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).with_name("screenshot.svg")
TURNS = ("Hello! Can you help me?", "What should I pack?")


async def draw() -> None:
    from kvchat.config import Config
    from kvchat.engine.models.model import load_model
    from kvchat.tui.app import KvChatApp

    app = KvChatApp(Config(model="demo", max_tokens=60, autosave=False),
                    lm=load_model("demo"), volatile=False)
    async with app.run_test(size=(120, 36)) as pilot:
        while app.active_conversation() is None:
            await pilot.pause(0.1)
        conversation = app.active_conversation()
        for text in TURNS:
            conversation.input.text = text
            await pilot.press("enter")
            await pilot.pause(0.2)
            while conversation.busy:
                await pilot.pause(0.1)
        await pilot.pause(0.5)
        app.save_screenshot(filename=OUT.name, path=str(OUT.parent))


if __name__ == "__main__":
    home = tempfile.mkdtemp(prefix="kvchat-screenshot-")
    os.environ["KVCHAT_HOME"] = home
    os.environ["KVCHAT_CONFIG_DIR"] = home + "/config"
    asyncio.run(draw())
    print(f"wrote {OUT}", file=sys.stderr)
