"""The strategy configuration: ``DistributedStrategy`` over the proto schema (``schema_view``),
its prototxt form, Paddle's fields, values and role makers. It stands in the strategies'
layer: the strategies read it, and it reads nothing above them.
"""
