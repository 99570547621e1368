"""Chat templates that requests bring (--trust-request-chat-template), rendered in a child process.

jinja2's sandbox keeps a template from reaching Python, but not from looping or allocating without
end. In the child a render gets RENDER_TIMEOUT_S of wall-clock time and MEMORY_LIMIT_BYTES of
address space; past the deadline the child is killed (and started again for the next request),
and the gateway's event loop and thread pool never run a client's Jinja. Run as a module, this
file is the child: it reads length-prefixed msgpack frames (template, variables) on stdin and
answers (text, error) on stdout."""
import asyncio
import os
import resource
import sys

import msgspec

from pagedserve.common.chat_template import ChatTemplateError, compile_template, render
from pagedserve.common.log import get_logger
from pagedserve.common.process import die_with_parent, environment_without_secrets

log = get_logger(__name__)

# A model's chat template renders in milliseconds: SmolLM2's took 18 ms here for 2048 messages (the
# most a request may send), so the deadline leaves a hundredfold margin.
RENDER_TIMEOUT_S = 2.0
# The child's address space: Python and jinja2 take 38 MB of it; the rest bounds what a template
# can build with the operations that BoundedSandbox does not count (str.ljust, the format filter).
MEMORY_LIMIT_BYTES = 1 << 30
# The child's CPU priority: a template spinning until its deadline yields the CPU to the gateway.
NICENESS = 10
_HEADER = 4


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_HEADER, "little") + payload


async def _read_frame(stream: asyncio.StreamReader) -> bytes:
    return await stream.readexactly(int.from_bytes(await stream.readexactly(_HEADER), "little"))


class TemplateWorker:
    """The gateway's side: one child, rendering one template at a time. start() starts it ahead of
    the first render, and every kill starts the next one, so that no request waits for Python to
    start (about 0.1 s of CPU, which would compete with the gateway mid-traffic)."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._spawning: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._encoder = msgspec.msgpack.Encoder()

    def start(self) -> None:
        """Starts the child in the background, unless it runs or starts already."""
        if self._process is None and self._spawning is None:
            self._spawning = asyncio.create_task(self._spawn())

    async def _spawn(self) -> None:
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env=environment_without_secrets())
            # Its first frame says it has imported what it needs and reads requests.
            try:
                await _read_frame(process.stdout)
            except asyncio.IncompleteReadError:
                raise RuntimeError(f"the chat template worker exited at start-up ({await process.wait()})") from None
            self._process = process
        finally:
            self._spawning = None

    async def render(self, source: str, variables: dict) -> str:
        """The template rendered with `variables`; raises ChatTemplateError when it fails, overruns
        its output or memory, or takes longer than RENDER_TIMEOUT_S."""
        try:
            request = _frame(self._encoder.encode((source, variables)))
        except (TypeError, OverflowError) as e:
            raise ChatTemplateError(f"the template variables cannot be passed on: {e}") from None
        async with self._lock:
            # The deadline is the render's: a start-up slowed by a busy machine does not count.
            self.start()
            if self._spawning is not None:
                await asyncio.shield(self._spawning)
            try:
                text, error = await asyncio.wait_for(self._call(request), RENDER_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self._restart("deadline")
                raise ChatTemplateError(f"the chat template did not finish within {RENDER_TIMEOUT_S:g} s") from None
            except (asyncio.IncompleteReadError, ConnectionError):
                await self._restart("crashed")
                raise ChatTemplateError("the chat template's render crashed") from None
            except BaseException:
                # Cancelled (the client left): the child's answer would reach the next request.
                await self._restart("cancelled")
                raise
        if error is not None:
            raise ChatTemplateError(error)
        return text

    async def _call(self, request: bytes) -> tuple[str | None, str | None]:
        process = self._process
        process.stdin.write(request)
        await process.stdin.drain()
        return msgspec.msgpack.decode(await _read_frame(process.stdout))

    async def _restart(self, reason: str) -> None:
        process = self._process
        log.warning("chat_template_worker_killed", reason=reason, pid=None if process is None else process.pid)
        await self._kill()
        self.start()

    async def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.returncode is None:
            process.kill()
        await process.wait()

    async def close(self) -> None:
        if self._spawning is not None:
            await asyncio.gather(self._spawning, return_exceptions=True)
        await self._kill()


def _render(payload: bytes) -> tuple[str | None, str | None]:
    source, variables = msgspec.msgpack.decode(payload)
    try:
        return render(compile_template(source), variables), None
    except ChatTemplateError as e:
        return None, str(e)


def main() -> None:
    die_with_parent()
    os.nice(NICENESS)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(hard, MEMORY_LIMIT_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    encoder = msgspec.msgpack.Encoder()
    stdout.write(_frame(b""))
    stdout.flush()
    while header := stdin.read(_HEADER):
        stdout.write(_frame(encoder.encode(_render(stdin.read(int.from_bytes(header, "little"))))))
        stdout.flush()


if __name__ == "__main__":
    main()
