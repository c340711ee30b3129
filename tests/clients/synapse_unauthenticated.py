"""Calls StreamMessages on a Synapse endpoint that requires a token, without one and
with a wrong one, as gRPC's own Python client (grpcio, C-core) does, and prints each
call's status code name and how long it took (seconds), one call per line.

    python synapse_unauthenticated.py HOST:PORT CALLS
"""

import os
import sys
import time

import grpc


def main() -> None:
    target, calls = sys.argv[1], int(sys.argv[2])
    channel = grpc.insecure_channel(target)
    grpc.channel_ready_future(channel).result(timeout=10)
    stream = channel.stream_stream(
        "/synapse.SynapseMessageService/StreamMessages",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )

    def requests():
        # An empty SynapseMessage, then the stream stays open as a live client's would.
        yield b""
        for _ in range(3):
            yield b""

    for i in range(calls):
        metadata = [] if i % 2 == 0 else [("authorization", "Bearer wrong")]
        started = time.monotonic()
        try:
            for _ in stream(requests(), metadata=metadata, timeout=10):
                pass
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        print(code, round(time.monotonic() - started, 3), flush=True)
    channel.close()


if __name__ == "__main__":
    main()
    # Every answer is printed. The interpreter's own exit can wait on grpcio's threads for
    # good now and then (a client-side hang: seen once in many runs, after all 30 answers),
    # so the process ends here.
    os._exit(0)
