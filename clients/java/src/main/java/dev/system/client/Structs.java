package dev.system.client;

import com.google.protobuf.ListValue;
import com.google.protobuf.NullValue;
import com.google.protobuf.Struct;
import com.google.protobuf.Value;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/** Converts between protobuf Struct (JSON objects on the wire) and plain Java values. */
public final class Structs {
  private Structs() {}

  /** A Struct as a map of strings, Doubles, Booleans, nulls, maps and lists. */
  public static Map<String, Object> toMap(Struct struct) {
    Map<String, Object> out = new LinkedHashMap<>();
    struct.getFieldsMap().forEach((k, v) -> out.put(k, toJava(v)));
    return out;
  }

  static Object toJava(Value value) {
    switch (value.getKindCase()) {
      case NUMBER_VALUE:
        return value.getNumberValue();
      case STRING_VALUE:
        return value.getStringValue();
      case BOOL_VALUE:
        return value.getBoolValue();
      case STRUCT_VALUE:
        return toMap(value.getStructValue());
      case LIST_VALUE:
        List<Object> list = new ArrayList<>();
        value.getListValue().getValuesList().forEach(v -> list.add(toJava(v)));
        return list;
      default:
        return null;
    }
  }

  /** A map of JSON-like Java values as a Struct. Throws IllegalArgumentException otherwise. */
  public static Struct fromMap(Map<String, ?> map) {
    Struct.Builder b = Struct.newBuilder();
    map.forEach((k, v) -> b.putFields(k, toValue(v)));
    return b.build();
  }

  @SuppressWarnings("unchecked")
  static Value toValue(Object o) {
    if (o == null) {
      return Value.newBuilder().setNullValue(NullValue.NULL_VALUE).build();
    }
    if (o instanceof Number n) {
      return Value.newBuilder().setNumberValue(n.doubleValue()).build();
    }
    if (o instanceof String s) {
      return Value.newBuilder().setStringValue(s).build();
    }
    if (o instanceof Boolean bool) {
      return Value.newBuilder().setBoolValue(bool).build();
    }
    if (o instanceof Map<?, ?> m) {
      return Value.newBuilder().setStructValue(fromMap((Map<String, ?>) m)).build();
    }
    if (o instanceof Iterable<?> it) {
      ListValue.Builder list = ListValue.newBuilder();
      it.forEach(v -> list.addValues(toValue(v)));
      return Value.newBuilder().setListValue(list).build();
    }
    throw new IllegalArgumentException("not a JSON value: " + o.getClass().getName());
  }

  /** A Struct as compact JSON text, for logs. */
  public static String toJson(Struct struct) {
    return Json.write(toMap(struct));
  }

  /** Reads an integer argument; throws ToolException (invalid input) when it is not one. */
  public static long intArg(Map<String, Object> input, String name) throws ToolException {
    Object v = input.get(name);
    if (!(v instanceof Number n) || n.doubleValue() != Math.rint(n.doubleValue())) {
      throw ToolException.invalidInput(name + " must be an integer");
    }
    return n.longValue();
  }

  /** Reads a string argument; throws ToolException (invalid input) when it is not one. */
  public static String stringArg(Map<String, Object> input, String name) throws ToolException {
    Object v = input.get(name);
    if (!(v instanceof String s) || s.isEmpty()) {
      throw ToolException.invalidInput(name + " must be a non-empty string");
    }
    return s;
  }
}
