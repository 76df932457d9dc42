package dev.system.client;

import java.util.Iterator;
import java.util.Map;

/** A small JSON writer for logs (the Debian jars carry no JSON library for protobuf-util). */
public final class Json {
  private Json() {}

  /** Compact JSON text of maps, lists, strings, numbers, booleans and nulls. */
  public static String write(Object value) {
    StringBuilder sb = new StringBuilder();
    write(sb, value);
    return sb.toString();
  }

  private static void write(StringBuilder sb, Object v) {
    if (v == null) {
      sb.append("null");
    } else if (v instanceof String s) {
      quote(sb, s);
    } else if (v instanceof Double d && d == Math.rint(d) && !d.isInfinite() && Math.abs(d) < 1e15) {
      sb.append(d.longValue());
    } else if (v instanceof Number || v instanceof Boolean) {
      sb.append(v);
    } else if (v instanceof Map<?, ?> m) {
      sb.append('{');
      Iterator<? extends Map.Entry<?, ?>> it = m.entrySet().iterator();
      while (it.hasNext()) {
        Map.Entry<?, ?> e = it.next();
        quote(sb, String.valueOf(e.getKey()));
        sb.append(':');
        write(sb, e.getValue());
        if (it.hasNext()) {
          sb.append(',');
        }
      }
      sb.append('}');
    } else if (v instanceof Iterable<?> list) {
      sb.append('[');
      Iterator<?> it = list.iterator();
      while (it.hasNext()) {
        write(sb, it.next());
        if (it.hasNext()) {
          sb.append(',');
        }
      }
      sb.append(']');
    } else {
      quote(sb, v.toString());
    }
  }

  private static void quote(StringBuilder sb, String s) {
    sb.append('"');
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      switch (c) {
        case '"' -> sb.append("\\\"");
        case '\\' -> sb.append("\\\\");
        case '\n' -> sb.append("\\n");
        case '\r' -> sb.append("\\r");
        case '\t' -> sb.append("\\t");
        default -> {
          if (c < 0x20) {
            sb.append(String.format("\\u%04x", (int) c));
          } else {
            sb.append(c);
          }
        }
      }
    }
    sb.append('"');
  }
}
