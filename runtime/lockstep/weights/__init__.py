"""Weight transfer: moving each new policy version from the trainer to every rollout engine (§7.2).

One preparation pipeline (pipeline.py: gather, convert to HF names and layout, size-bounded buckets)
feeds the transports (broadcast.py, ipc.py, disk_delta.py, p2p.py, from_disk.py, inprocess.py), all
behind the WeightTransport protocol of transport.py, timed phase by phase (phases.py); preflight.py
checks that engines hold exactly the trainer's weights. Helpers: lockstep.models.st_bytes (raw
safetensors bytes, xxh3-128, durable writes; the trainer's sharded load reads through it too),
delta_codec.py / delta_encoder.py (xor/overwrite + zstd), reshard.py (SGLang's TP layout);
lockstep.serving.loop gives each transport a private event loop for the async engine client.
docs/weights.md explains it all.
"""
