"""Code more than one process kind shares, one subpackage per responsibility.

    contract/   what two processes must agree on: messages, the Redis key schema, the
                control-plane transport, sampling parameters, block hashes, metrics text
    worker/     the worker process around a role: options, lifecycle, registry publisher

The command line and `pdserve up` are the top layer, in launcher/. docs/architecture.md maps
every folder and which folders it may import.
"""
