"""`kvforge profile`: where each step's time goes, by op class, against the device's roofline.

    ranges.py      the record_function ranges, installed on an engine only while it is profiled
    op_classes.py  the op classes and how a profiler event's name maps to one
    timeline.py    profiler events -> per-step times by op class (one rank's timeline)
    work.py        FLOPs and bytes of each op class in a step, from the shapes
    roofline.py    peaks (measured on the CPU, datasheet on GPUs) and the verdicts
    ranks.py       the other ranks of a tensor/pipeline-parallel engine record their own timelines
    report.py      terminal table and JSON; plot.py the PNG; cli.py the command
"""
