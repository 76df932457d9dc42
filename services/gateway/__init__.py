"""The gateway: holds game servers' connections and turns their players' requests into
route-then-execute calls. Thin by design: no routing or module logic lives here."""
