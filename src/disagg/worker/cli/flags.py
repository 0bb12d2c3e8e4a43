"""The flags of the commands' own options that are not settings classes (`tp-ranks`, `drain`,
`make-model`, `up`: required, exclusive, repeatable, beside a positional), named once for their
parsers and for what writes their command lines: the operator's pods and hooks, the tests.

No imports: the operator reads it without the worker's dependencies.
"""


class TpRanks:
    """`disagg tp-ranks`."""

    LEADER = "--leader"
    FIRST_RANK = "--first-rank"
    NODE_INDEX = "--node-index"
    COUNT = "--count"
    HOST = "--host"
    THREADS = "--threads"
    CONNECT_TIMEOUT = "--connect-timeout"
    LOG_LEVEL = "--log-level"


class Drain:
    """`disagg drain` (the worker pod's preStop hook)."""

    URL = "--url"
    TIMEOUT = "--timeout"


class MakeModel:
    """`disagg make-model DIR`."""

    PRESET = "--preset"
    SEED = "--seed"
    DTYPE = "--dtype"
    SHARD_SIZE = "--shard-size"
    FORCE = "--force"


class Up:
    """`disagg up`'s own options (the workers' and the router's settings come with their classes)."""

    MODEL = "--model"
    PREFILL = "--prefill"
    DECODE = "--decode"
    BOTH = "--both"
    PORT = "--port"
    PREFILL_TP = "--prefill-tp"
    DECODE_TP = "--decode-tp"
    RUN_DIR = "--run-dir"
    DEMO = "--demo"
    TIMEOUT = "--timeout"
    WORKER_ARG = "--worker-arg"
    PEER_IDENTITY = "--peer-identity"
