"""Tools that run the fleet rather than use it: none of them is imported by the client, the
gateway or the workers.

    bench/     ``make bench``: workloads replayed against the fleet, its peers and the limit
    chaos/     ``make chaos`` and ``make ha-check``: faults injected under load, every request
               counted
    demo/      ``make demo``: the main job on real input, end to end
    soak.py    ``fleet soak``: memory stays flat under a long run
    gpucheck/  ``make gpu-check``: the device runtime on a CUDA machine
"""
