"""Weight transfer: moving each new policy version from the trainer to every rollout engine (seed §7.2).

One preparation pipeline (pipeline.py: gather, convert to HF names and layout, size-bounded buckets)
feeds four transports (broadcast.py, ipc.py, disk_delta.py, p2p.py), all behind the WeightTransport
protocol of transport.py; preflight.py checks that engines hold exactly the trainer's weights.
Helpers: st_bytes.py (raw safetensors bytes, xxh3-128, durable writes), delta_codec.py (xor/overwrite
+ zstd); lockstep.serving.loop gives each transport a private event loop for the async engine client.
docs/weights.md explains it all.
"""
