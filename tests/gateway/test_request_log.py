"""SEC-19: with --enable-log-requests, a request's constraint, stop strings and logit_bias are logged
cut to a few hundred characters (with their length and a hash), so that no line grows to megabytes."""
COMPLETIONS = "/v1/completions"


def _lines(capsys, event: str) -> list[str]:
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if event in line]


async def test_large_parameters_are_logged_cut(http, serve, capsys):
    url = await serve(log_requests=True)
    body = {"prompt": "hi", "max_tokens": 2, "guided_regex": "x*" + "y?" * 30_000,
            "stop": ["s" * 1024] * 4, "logit_bias": {str(t): 1 for t in range(250)}}
    async with http.post(url + COMPLETIONS, json=body) as r:
        assert r.status == 200, await r.text()
    line, = _lines(capsys, "request_finished")
    assert len(line) < 2048 and line.count("characters, sha256") == 3


async def test_a_4_mib_regex_is_not_logged_whole(http, serve, capsys):
    url = await serve(log_requests=True)
    body = ('{"prompt": "hi", "max_tokens": 1, "guided_regex": "' + "x" * 4_000_000 + '"}').encode()
    async with http.post(url + COMPLETIONS, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "guided_regex"
    assert all(len(line) < 2048 for line in _lines(capsys, "request_"))
