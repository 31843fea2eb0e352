"""Communication: named process groups ("links"), the collectives a schedule issues on them, the order
each link issues them in and the in-flight `Pending` (`links`), a run's links by role and stream
(`link_groups`), gloo's
point-to-point reduce-scatter and all-gather (`point_to_point`), timings of a collective's completion
on its device (`device_time`), the flat gradient buckets a collective carries (`buckets`), who the
other ranks are when one fails (`peers`), and local gloo worker processes for the probe and tests
(`local_workers`). Below the schedules, reducers and measurements that use it; import the modules
themselves (this file imports nothing, so that torch-free code can name the folder)."""
