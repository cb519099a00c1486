"""A job's outputs as an async stream for a route, and server-sent events."""

import asyncio
from typing import AsyncIterator, Optional, Union

from pydantic import BaseModel

from ..runtime.outputs import Failed, Finished, Output
from ..runtime.worker import EngineWorker, Job

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JobStream:
    """A submitted job's outputs as an async iterator; leaving early (client gone) cancels the job."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.queue: "asyncio.Queue[Output]" = asyncio.Queue()

    def sink(self, item: Output) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def submit(self, job: Job) -> "JobStream":
        self.job = self.worker.submit(job)  # a stopped engine answers it with Failed at once
        return self

    async def __aiter__(self) -> AsyncIterator[Output]:
        finished = False
        try:
            while not finished:
                item = await self.queue.get()
                finished = isinstance(item, (Finished, Failed))
                yield item
        finally:
            if not finished:
                self.job.cancel()


def sse(payload: Union[BaseModel, str], event: Optional[str] = None) -> str:
    """One server-sent event, named `event` when given (Anthropic's clients dispatch on the name)."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    name = f"event: {event}\n" if event else ""
    return f"{name}data: {data}\n\n"
