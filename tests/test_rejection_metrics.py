"""/metrics counts a refused request once, under its reason, and nothing for requests it let
through (the 413 for a body over --max-request-bytes was once counted on every request)."""

from __future__ import annotations

CAP = 8 * 2**20  # the default --max-request-bytes


def _body_too_large(c) -> float:
    line = next((x for x in c.get("/metrics").text.splitlines()
                 if x.startswith('radixlm_rejected_requests_total{reason="body_too_large"}')), None)
    return 0.0 if line is None else float(line.split()[-1])


def test_body_too_large_counts_only_bodies_refused_for_their_size(server):
    with server.client() as c:
        before = _body_too_large(c)
        for _ in range(3):
            ok = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
            assert ok.status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/v1/models").status_code == 200
        assert _body_too_large(c) == before  # the /metrics reads between are requests too
        declared = c.post("/generate", content=b"x" * (CAP + 1), headers={"content-type": "application/json"})
        assert declared.status_code == 413
        assert _body_too_large(c) == before + 1

        def chunked():  # no content-length: the cap is found while reading
            for _ in range(9):
                yield b"x" * 2**20

        streamed = c.post("/generate", content=chunked(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert _body_too_large(c) == before + 2
